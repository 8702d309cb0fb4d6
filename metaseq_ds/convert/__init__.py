"""Moving weights between formats: our checkpoints <-> Hugging Face OPT, and metaseq/fairseq imports.

    mseq export hf CKPT OUT            # hf_export: our checkpoint -> OPTForCausalLM folder
    mseq import hf HF_DIR OUT          # hf_import: OPT folder -> our (weights-only) checkpoint
    mseq import metaseq CKPT OUT       # metaseq_import: metaseq/fairseq .pt (singleton or parts)

Key maps are tables: `metaseq_ds.models.hf_opt` (ours <-> HF) and `key_maps` (metaseq -> ours).
"""
