"""Which parameters Muon steps, and the optimizer groups that say so (see muon.py for the step itself).

Muon takes every 2-D weight that is neither an embedding nor the output layer; the rest stays with AdamW. With
`--muon-split-qkv` each fused QKV weight carries its per-query-group (q, k, v) row counts, so Muon orthogonalizes
all queries, all keys and all values as three matrices (with `--attention-output-gate` the gates are a fourth).
"""


def is_muon_parameter(param):
    """A 2-D weight that is neither an embedding nor the output layer."""
    return (param.dim() == 2 and not getattr(param, "is_embedding_or_output_parameter", False)
            and not getattr(param, "is_embedding_parameter", False))


def fused_qkv_splits(model_chunks):
    """{id(fused QKV weight): (q rows, k rows, v rows) per query group} for the attention layers of the chunks;
    (q, gate, k, v) rows with `--attention-output-gate`, whose gate rows are then a matrix of their own."""
    from megatron.core.transformer.attention_head_transforms import fused_qkv_rows_per_group

    splits = {}
    for chunk in model_chunks:
        for module in chunk.modules():
            linear_qkv = getattr(module, "linear_qkv", None)
            weight = getattr(linear_qkv, "weight", None)
            if weight is None or not hasattr(module, "heads_per_group") or not hasattr(module, "head_dim"):
                continue
            splits[id(weight)] = fused_qkv_rows_per_group(module.heads_per_group, module.head_dim,
                                                          getattr(module, "output_gate", False))
    return splits


def muon_param_groups(param_groups, model_chunks, config):
    """`param_groups` with each group's Muon parameters moved to Muon groups of their own (same lr and weight
    decay settings), fused QKV weights apart when `config.muon_split_qkv`. AdamW groups keep their order."""
    qkv_splits = fused_qkv_splits(model_chunks) if config.muon_split_qkv else {}
    muon_settings = dict(use_muon=True, momentum=config.muon_momentum, nesterov=config.muon_use_nesterov,
                         ns_steps=config.muon_num_ns_steps, scale_mode=config.muon_scale_mode,
                         extra_scale_factor=config.muon_extra_scale_factor, tp_mode=config.muon_tp_mode,
                         fp32_matmul_prec=config.muon_fp32_matmul_prec)
    muon_groups, adam_groups = [], []
    for group in param_groups:
        by_split, adam_params = {}, []
        for param in group["params"]:
            if is_muon_parameter(param):
                by_split.setdefault(qkv_splits.get(id(param)), []).append(param)
            else:
                adam_params.append(param)
        for qkv_split, params in by_split.items():
            muon_groups.append({**group, **muon_settings, "qkv_split": qkv_split, "params": params})
        if adam_params:
            adam_groups.append({**group, "params": adam_params})
    return muon_groups + adam_groups
