"""Which layers of a hybrid model are Mamba, attention and MLP layers (upstream's `allocate_layers`).

`--hybrid-override-pattern` spells the layers out, one symbol each (`M` Mamba, `*` attention, `-` MLP, `E` MoE).
Without it, `--hybrid-attention-ratio` and `--hybrid-mlp-ratio` give the shares of attention and MLP layers (rounded to
whole layers) and the rest are Mamba layers: here the attention layers are spread evenly among the Mamba and
attention layers (each at the middle of its share), and each of those is followed by its even share of the MLP
layers (`M-M-M*-...`). The placement of upstream's own allocation may differ; give the pattern to pin it.
"""

import warnings

from megatron.core.ssm.mamba_config import ATTENTION, HYBRID_SYMBOLS, MAMBA, MLP, PATTERN_FLAG


def _spread(count, positions):
    """`count` of `positions`, evenly spaced (each the middle of its share)."""
    return [positions[int((index + 0.5) * len(positions) / count)] for index in range(count)]


def pattern_from_ratios(total_layers, attention_ratio, mlp_ratio):
    for flag, ratio in (("--hybrid-attention-ratio", attention_ratio), ("--hybrid-mlp-ratio", mlp_ratio)):
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"{flag} must be in [0, 1], got {ratio}")
    if attention_ratio + mlp_ratio > 1.0:
        raise ValueError(f"--hybrid-attention-ratio {attention_ratio} plus --hybrid-mlp-ratio {mlp_ratio} exceed 1")
    attention = round(total_layers * attention_ratio)
    mlp = min(round(total_layers * mlp_ratio), total_layers - attention)
    mixers = total_layers - mlp  # the Mamba and attention layers, each followed by its share of the MLP layers
    if mixers == 0:
        return MLP * total_layers
    sequence = [MAMBA] * mixers
    for position in _spread(attention, list(range(mixers))) if attention else []:
        sequence[position] = ATTENTION
    layers = []
    for index, symbol in enumerate(sequence):
        following = (index + 1) * mlp // mixers - index * mlp // mixers
        layers.append(symbol + MLP * following)
    return "".join(layers)


def allocate_layers(total_layers, attention_ratio=0.0, mlp_ratio=0.0, override_pattern=None):
    """The pattern of a hybrid model of `total_layers` layers (see the module docstring)."""
    if override_pattern is None:
        return pattern_from_ratios(total_layers, attention_ratio, mlp_ratio)
    if len(override_pattern) != total_layers or set(override_pattern) - set(HYBRID_SYMBOLS):
        raise ValueError(f"{PATTERN_FLAG} {override_pattern!r} must give one of {', '.join(HYBRID_SYMBOLS)} (Mamba, "
                         f"attention, MLP, MoE) for each of the --num-layers {total_layers} layers")
    actual = (override_pattern.count(ATTENTION) / total_layers, override_pattern.count(MLP) / total_layers)
    if (attention_ratio or mlp_ratio) and (round(actual[0] * total_layers) != round(attention_ratio * total_layers)
                                           or round(actual[1] * total_layers) != round(mlp_ratio * total_layers)):
        warnings.warn(f"{PATTERN_FLAG} {override_pattern!r} sets the layers; --hybrid-attention-ratio "
                      f"{attention_ratio} and --hybrid-mlp-ratio {mlp_ratio} disagree with it and are ignored")
    return override_pattern
