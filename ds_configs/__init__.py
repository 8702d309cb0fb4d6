"""DeepSpeed JSON presets (`--deepspeed-config zero3`, ...), installed as the package `metaseq_ds.ds_configs`."""
