"""RoPE in a Hugging Face Llama config.json: our --rotary-base, --use-rope-scaling / --rope-scaling-factor (HF's
`rope_type: "llama3"`), --rotary-seq-len-interpolation-factor (`rope_type: "linear"`) and --position-embedding-type
yarn with the --yarn-* flags (`rope_type: "yarn"`), both ways."""

from megatron.core.models.common.embeddings.rotary_pos_embedding import (
    LLAMA3_HIGH_FREQ_FACTOR,
    LLAMA3_LOW_FREQ_FACTOR,
    LLAMA3_ORIGINAL_MAX_POSITION_EMBEDDINGS,
)

from hf_errors import ConversionError

# The llama3 rope_scaling values our rotary embedding fixes (only the factor is a flag, --rope-scaling-factor).
LLAMA3_FIXED_ROPE_SCALING = {"low_freq_factor": LLAMA3_LOW_FREQ_FACTOR, "high_freq_factor": LLAMA3_HIGH_FREQ_FACTOR,
                             "original_max_position_embeddings": LLAMA3_ORIGINAL_MAX_POSITION_EMBEDDINGS}


def hf_rope_config(shape) -> dict:
    """`shape` (a hf_mapping.ModelShape) -> config.json's rope_scaling (older transformers read it) and
    rope_parameters (newer ones)."""
    theta = float(shape.rotary_base)
    if shape.rotary_seq_len_interpolation_factor is not None:
        scaling = {"rope_type": "linear", "factor": float(shape.rotary_seq_len_interpolation_factor)}
    elif shape.use_rope_scaling:
        scaling = {"rope_type": "llama3", "factor": float(shape.rope_scaling_factor), **LLAMA3_FIXED_ROPE_SCALING}
    else:
        return {"rope_scaling": None, "rope_parameters": {"rope_type": "default", "rope_theta": theta}}
    return {"rope_scaling": scaling, "rope_parameters": {**scaling, "rope_theta": theta}}


def _scaling_factor(scaling, rope_type, path):
    """The positive `factor` of a rope_scaling."""
    if "factor" not in scaling:
        raise ConversionError(f"{path}: RoPE scaling '{rope_type}' (config.json rope_scaling / rope_parameters) "
                              "without 'factor'")
    factor = scaling["factor"]
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
        raise ConversionError(f"{path}: RoPE scaling '{rope_type}' with factor {factor!r}: it must be a positive "
                              "number")
    return float(factor)


def _llama3_scaling_factor(scaling, path):
    """--rope-scaling-factor of a llama3 rope_scaling whose other values are the ones we fix."""
    factor = _scaling_factor(scaling, "llama3", path)
    for key, fixed in LLAMA3_FIXED_ROPE_SCALING.items():
        if key not in scaling:
            raise ConversionError(f"{path}: RoPE scaling 'llama3' (config.json rope_scaling / rope_parameters) "
                                  f"without '{key}'")
        if scaling[key] != fixed:
            raise ConversionError(
                f"{path}: RoPE scaling 'llama3' with {key} {scaling[key]}: our rotary embedding (--use-rope-scaling) "
                f"fixes {', '.join(f'{name} {value}' for name, value in LLAMA3_FIXED_ROPE_SCALING.items())}")
    return factor


def rope_flags_of_config(config, path):
    """--position-embedding-type, --rotary-base, --use-rope-scaling, --rope-scaling-factor,
    --rotary-seq-len-interpolation-factor and the --yarn-* flags (rope_type "yarn") of a Llama config.json."""
    parameters = config.get("rope_parameters") or {}
    # transformers reads rope_scaling where a config has it (older ones know nothing else)
    scaling = config.get("rope_scaling") or parameters
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ("default", "llama3", "linear", "yarn"):
        raise ConversionError(f"{path}: RoPE scaling '{rope_type}' (config.json rope_scaling / rope_parameters) "
                              "has no counterpart in our rotary embedding (plain RoPE with --rotary-base, "
                              "'llama3' as --use-rope-scaling, 'linear' as --rotary-seq-len-interpolation-factor, "
                              "'yarn' as --position-embedding-type yarn)")
    factor = parameters.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if factor != 1.0:
        raise ConversionError(f"{path}: partial_rotary_factor {factor}: Llama rotates whole heads")
    flags = {"position_embedding_type": "rope",
             "rotary_base": scaling.get("rope_theta", parameters.get("rope_theta", config.get("rope_theta", 10000.0)))}
    if rope_type == "yarn":
        flags.update(yarn_flags_of_scaling(scaling, config, path))
    elif rope_type == "llama3":
        flags.update(use_rope_scaling=True, rope_scaling_factor=_llama3_scaling_factor(scaling, path))
    elif rope_type == "linear":
        flags["rotary_seq_len_interpolation_factor"] = _scaling_factor(scaling, "linear", path)
    return flags


# ModelShape's YaRN fields (--position-embedding-type yarn) and their defaults, as the training flags have them.
YARN_DEFAULTS = {"yarn_rotary_scaling_factor": 1.0, "yarn_original_max_position_embeddings": 4096,
                 "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0, "yarn_mscale": 1.0, "yarn_mscale_all_dim": 0.0,
                 "yarn_correction_range_round_to_int": True}


def _positive(scaling, key, default, path):
    value = scaling.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConversionError(f"{path}: RoPE scaling 'yarn' with {key} {value!r}: it must be a positive number")
    return value


def yarn_flags_of_scaling(scaling, config, path):
    """The ModelShape fields of a 'yarn' rope_scaling / rope_parameters (--position-embedding-type yarn and the
    --yarn-* flags), read as transformers' `_compute_yarn_parameters` reads them."""
    if config.get("original_max_position_embeddings") is not None:  # transformers prefers the top-level key
        scaling = {**scaling, "original_max_position_embeddings": config["original_max_position_embeddings"]}
    original = int(_positive(scaling, "original_max_position_embeddings", config.get("max_position_embeddings"),
                             path) or 0)
    if not original:
        raise ConversionError(f"{path}: RoPE scaling 'yarn' without original_max_position_embeddings or "
                              "max_position_embeddings")
    factor = scaling.get("factor")
    if factor is None:  # transformers: the ratio of the context lengths
        factor = config.get("max_position_embeddings", original) / original
    factor = _scaling_factor({"factor": factor}, "yarn", path)
    # transformers divides ms(s, mscale) by ms(s, mscale_all_dim) only when both are given and non-zero
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if not (mscale and mscale_all_dim):
        mscale, mscale_all_dim = 1.0, 0.0
    flags = {"position_embedding_type": "yarn", "yarn_rotary_scaling_factor": factor,
             "yarn_original_max_position_embeddings": original,
             # transformers reads a missing or zero beta as the default
             "yarn_beta_fast": float(_positive(scaling, "beta_fast", 32.0, path) if scaling.get("beta_fast") else 32.0),
             "yarn_beta_slow": float(_positive(scaling, "beta_slow", 1.0, path) if scaling.get("beta_slow") else 1.0),
             "yarn_mscale": float(mscale), "yarn_mscale_all_dim": float(mscale_all_dim),
             "yarn_correction_range_round_to_int": bool(scaling.get("truncate", True))}
    attention_factor = scaling.get("attention_factor")
    if attention_factor is not None:
        from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import yarn_cos_sin_scale

        ours = yarn_cos_sin_scale(factor, flags["yarn_mscale"], flags["yarn_mscale_all_dim"])
        if abs(attention_factor - ours) > 1e-6 * ours:
            raise ConversionError(f"{path}: RoPE scaling 'yarn' with attention_factor {attention_factor}: our YaRN "
                                  f"multiplies cos and sin by ms(factor, mscale) / ms(factor, mscale_all_dim) = "
                                  f"{ours:.6g} (--yarn-mscale, --yarn-mscale-all-dim)")
    return flags


def hf_yarn_rope_config(shape) -> dict:
    """config.json's rope_scaling and rope_parameters of a --position-embedding-type yarn model."""
    scaling = {"rope_type": "yarn", "factor": float(shape.yarn_rotary_scaling_factor),
               "beta_fast": float(shape.yarn_beta_fast), "beta_slow": float(shape.yarn_beta_slow),
               "truncate": bool(shape.yarn_correction_range_round_to_int),
               "original_max_position_embeddings": int(shape.yarn_original_max_position_embeddings)}
    mscale, mscale_all_dim = float(shape.yarn_mscale), float(shape.yarn_mscale_all_dim)
    if mscale and mscale_all_dim:
        scaling.update(mscale=mscale, mscale_all_dim=mscale_all_dim)
    elif mscale != 1.0:  # transformers reads the pair only when both are non-zero: give the factor itself
        from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import yarn_cos_sin_scale

        scaling["attention_factor"] = yarn_cos_sin_scale(shape.yarn_rotary_scaling_factor, mscale, mscale_all_dim)
    return {"rope_scaling": scaling, "rope_parameters": {**scaling, "rope_theta": float(shape.rotary_base)}}


def yarn_training_flags(shape) -> list:
    """pretrain_gpt.py's --yarn-* flags of a --position-embedding-type yarn `shape` (those off their default)."""
    if shape.position_embedding_type != "yarn":
        return []
    flags = []
    for name, default in YARN_DEFAULTS.items():
        value = getattr(shape, name)
        if value == default:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(default, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags.append(f"{flag} {value!r}")
    return flags
