"""RoPE in a Hugging Face Llama config.json: our --rotary-base, --use-rope-scaling / --rope-scaling-factor (HF's
`rope_type: "llama3"`) and --rotary-seq-len-interpolation-factor (`rope_type: "linear"`), both ways."""

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
    """--rotary-base, --use-rope-scaling, --rope-scaling-factor and --rotary-seq-len-interpolation-factor of a
    Llama config.json."""
    parameters = config.get("rope_parameters") or {}
    # transformers reads rope_scaling where a config has it (older ones know nothing else)
    scaling = config.get("rope_scaling") or parameters
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ("default", "llama3", "linear"):
        raise ConversionError(f"{path}: RoPE scaling '{rope_type}' (config.json rope_scaling / rope_parameters) "
                              "has no counterpart in our rotary embedding (plain RoPE with --rotary-base, "
                              "'llama3' as --use-rope-scaling, 'linear' as --rotary-seq-len-interpolation-factor)")
    factor = parameters.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if factor != 1.0:
        raise ConversionError(f"{path}: partial_rotary_factor {factor}: Llama rotates whole heads")
    flags = {"rotary_base": scaling.get("rope_theta", parameters.get("rope_theta", config.get("rope_theta", 10000.0)))}
    if rope_type == "llama3":
        flags.update(use_rope_scaling=True, rope_scaling_factor=_llama3_scaling_factor(scaling, path))
    elif rope_type == "linear":
        flags["rotary_seq_len_interpolation_factor"] = _scaling_factor(scaling, "linear", path)
    return flags
