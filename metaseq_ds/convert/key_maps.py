"""metaseq / fairseq `transformer_lm` state dict keys -> ours, and how model-parallel parts split.

One table per direction, `{}` standing for the layer index (ours <-> Hugging Face lives in
`metaseq_ds.models.hf_opt`). metaseq's fused `qkv_proj` has no single key of ours: it is
split into q/k/v by `metaseq_import`, with rows ordered K, V, Q within each part.
"""

from metaseq_ds.distributed import tensor_parallel

METASEQ_TOP_LEVEL_KEYS = {
    "decoder.embed_tokens.weight": "decoder.embed_tokens.weight",
    "decoder.embed_positions.weight": "decoder.embed_positions.weight",
    "decoder.project_in_dim.weight": "decoder.project_in.weight",
    "decoder.project_out_dim.weight": "decoder.project_out.weight",
    "decoder.layer_norm.weight": "decoder.final_layer_norm.weight",
    "decoder.layer_norm.bias": "decoder.final_layer_norm.bias",
    "decoder.output_projection.weight": "decoder.output_projection.weight",
    "decoder.embed_out": "decoder.output_projection.weight",  # fairseq before 0.10
}

METASEQ_LAYER_KEYS = {
    f"decoder.layers.{{}}.{module}.{param}": f"decoder.layers.{{}}.{module}.{param}"
    for module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj",
                   "self_attn_layer_norm", "fc1", "fc2", "final_layer_norm")
    for param in ("weight", "bias")
}

FUSED_QKV = "decoder.layers.{}.self_attn.qkv_proj.{}"  # layer, weight|bias
FUSED_ORDER = ("k", "v", "q")  # row blocks of qkv_proj within one model-parallel part

# Bookkeeping entries, not weights: a version counter, sinusoids' device anchor.
DROPPED_KEYS = ("decoder.version", "decoder.embed_positions._float_tensor")

def metaseq_key_map(num_layers: int) -> dict:
    keys = dict(METASEQ_TOP_LEVEL_KEYS)
    for layer in range(num_layers):
        keys.update({theirs.format(layer): ours.format(layer) for theirs, ours in METASEQ_LAYER_KEYS.items()})
    return keys


def partition_dim(key: str):
    """The dim a metaseq model-parallel part splits `key` (metaseq's name) on, or None when every
    part holds all of it. metaseq's Megatron layers split as our tensor-parallel plan does, so the
    plan's table answers, for our name of the key (a fused qkv_proj splits as its q/k/v do)."""
    ours = METASEQ_TOP_LEVEL_KEYS.get(key, key.replace(".qkv_proj.", ".q_proj."))
    return tensor_parallel.partition_dim(ours)
