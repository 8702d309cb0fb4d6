"""`benchmarks/profile_train.py`'s summaries, checked where no GPU is. Its CUDA summary runs only
in a lent GPU's few minutes, so its arithmetic is checked here on made-up kernel spans, and its
rule from names to kinds on the kernel names that CUDA profiles of this step print."""

import re
from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

from benchmarks.profile_train import gpu_summary, kind


@pytest.mark.parametrize("name, expected", [
    # cuBLAS on Hopper (both of its naming schemes), CUTLASS, cuBLAS on Ampere
    ("nvjet_tst_192x192_64x3_2x1_v_bz_coopB_TNT", "matmul"),
    ("nvjet_sm90_hss_320x128_64x3_1x2_h_bz_coopA_NNT", "matmul"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas",
     "matmul"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>(Params)", "matmul"),
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_tn", "matmul"),
    # torch's flash and memory-efficient attention, cuDNN's
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 64, 4, false, false, cutlass::bfloat16_t>>(Params)",
     "attention"),
    ("fmha_cutlassB_bf16_aligned_64x64_k64_sm80(PyTorchMemEffAttention::AttentionBackwardKernel)", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0", "attention"),
    # everything else: elementwise, reductions, the loss's softmax, collectives, copies
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>(int, T1, T2)", "other"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::LogSoftMaxForwardEpilogue>",
     "other"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "other"),
    ("Memcpy HtoD (Pinned -> Device)", "other"),
    # the CPU's op names
    ("mkldnn::_linear_pointwise", "matmul"),
    ("aten::addmm_", "matmul"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", "attention"),
    ("aten::_log_softmax_backward_data", "other"),
    ("aten::bernoulli_", "other"),
])
def test_kernel_and_op_names_fall_in_their_kind(name, expected):
    assert kind(name) == expected


def _cuda_span(start_ms, end_ms, name):
    return SimpleNamespace(device_type=DeviceType.CUDA, name=name,
                           time_range=SimpleNamespace(start=start_ms * 1e3, end=end_ms * 1e3))  # microseconds


def test_gpu_summary_counts_overlaps_once_and_the_idle_gaps_between_kernels(capsys):
    events = [
        _cuda_span(0, 100, "nvjet_tst_192x192_64x3_2x1_v_bz_coopB_TNT"),
        _cuda_span(100, 150, "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<>"),
        _cuda_span(170, 180, "void at::native::vectorized_elementwise_kernel<4>"),  # 20 ms idle before it
        _cuda_span(175, 200, "ncclDevKernel_AllGather_RING_LL"),  # another stream: 5 ms overlap, counted once
        _cuda_span(230, 235, "Memset (Device)"),  # 30 ms idle before it
        SimpleNamespace(device_type=DeviceType.CPU, name="aten::mm",  # host ops are not kernels
                        time_range=SimpleNamespace(start=0.0, end=500e3)),
    ]
    prof = SimpleNamespace(events=lambda: events)

    gpu_summary(prof, wall_seconds=0.5, steps=2, top=3)  # 250 ms a step

    printed = capsys.readouterr().out
    summary = printed.splitlines()[-1]
    assert summary == ("summary: 250.0 ms a step: matmul 50.0 ms (20%), attention 25.0 ms (10%), other 20.0 ms (8%), "
                       "GPU idle between kernels 25.0 ms (10%, 1 gaps over 10 us)")
    assert "GPU busy 92.5 ms, idle between kernels 25.0 ms" in printed  # 185 ms busy, 50 idle, over 2 steps
    top = [line.split()[0] for line in printed.splitlines() if re.match(r"\s+[\d.]+ ms/step", line)]
    assert top == ["50.00", "25.00", "12.50"]  # the 3 longest kernels, per step
