"""metaseq / fairseq `transformer_lm` state dict keys -> ours, and how model-parallel parts split.

One table per direction, `{}` standing for the layer index (ours <-> Hugging Face lives in
`metaseq_ds.models.hf_opt`). metaseq's fused `qkv_proj` has no single key of ours: it is
split into q/k/v by `metaseq_import`, with rows ordered K, V, Q within each part.
"""

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

# Model-parallel parts: column-parallel tensors are split on dim 0 (output rows, vocabulary
# rows), row-parallel weights on dim 1 (input columns); everything else is replicated.
# Keys here are metaseq's, after the layer prefix `decoder.layers.{i}.` where there is one.
PARTITION_DIM = {
    "decoder.embed_tokens.weight": 0,
    "decoder.output_projection.weight": 0,
    "self_attn.qkv_proj.weight": 0,
    "self_attn.qkv_proj.bias": 0,
    "self_attn.q_proj.weight": 0,
    "self_attn.q_proj.bias": 0,
    "self_attn.k_proj.weight": 0,
    "self_attn.k_proj.bias": 0,
    "self_attn.v_proj.weight": 0,
    "self_attn.v_proj.bias": 0,
    "fc1.weight": 0,
    "fc1.bias": 0,
    "self_attn.out_proj.weight": 1,
    "fc2.weight": 1,
}


def metaseq_key_map(num_layers: int) -> dict:
    keys = dict(METASEQ_TOP_LEVEL_KEYS)
    for layer in range(num_layers):
        keys.update({theirs.format(layer): ours.format(layer) for theirs, ours in METASEQ_LAYER_KEYS.items()})
    return keys


def partition_dim(key: str):
    """The dim a model-parallel part splits `key` on, or None when every part holds all of it."""
    if key.startswith("decoder.layers."):
        key = key.split(".", 3)[3]
    return PARTITION_DIM.get(key)
