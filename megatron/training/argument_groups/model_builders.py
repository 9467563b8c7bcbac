"""Upstream flags that pick another way of building the model than this build's Megatron-Core GPT and hybrid
models: the legacy models, layer specs (other than the hybrid stack's), an encoder-decoder's decoder depth, and
Transformer Engine export. They parse, so an upstream launch script reaches validation, and each stops there
with what to do."""

from megatron.training.argument_groups.hybrid import MAMBA_SPEC

MEGATRON_CORE_GPT_ONLY = "this build has only the Megatron-Core GPT model, built from the command-line flags"


def add_arguments(parser):
    group = parser.add_argument_group("other model builders (not supported)")
    group.add_argument("--use-legacy-models", action="store_true",
                       help="Upstream: the legacy (pre-Megatron-Core) models. Not supported here: an error.")
    group.add_argument("--spec", nargs="*", default=None,
                       help="Upstream: <module function> returning a layer spec. Layers here are built from the "
                       "transformer config directly (no specs): an error.")
    group.add_argument("--decoder-num-layers", type=int, default=None,
                       help="Upstream: the decoder's layers of an encoder-decoder (T5) model. GPT is decoder-only "
                       "and takes its depth from --num-layers: an error.")
    group.add_argument("--export-te", action="store_true",
                       help="Upstream: export a Transformer Engine model (modelopt). Not supported here: an error.")


def validate(args):
    stops = (
        ("--use-legacy-models", args.use_legacy_models, f"{MEGATRON_CORE_GPT_ONLY}: drop --use-legacy-models"),
        ("--spec", args.spec is not None and list(args.spec) != MAMBA_SPEC,
         "layers here are built from the transformer config, not from layer specs: drop --spec and describe the "
         "layer with flags (--normalization, --swiglu, --qk-layernorm, --multi-latent-attention, --num-experts, "
         "...; a hybrid model's layers with --hybrid-override-pattern)"),
        ("--decoder-num-layers", args.decoder_num_layers is not None,
         "it sets the decoder depth of an encoder-decoder (T5) model; GPT is decoder-only: give its layers with "
         "--num-layers and drop --decoder-num-layers"),
        ("--export-te", args.export_te,
         "there is no Transformer Engine export: drop --export-te; checkpoints convert with "
         "tools/checkpoint/convert_checkpoint.py (e.g. --to hf), and --transformer-impl transformer_engine trains "
         "TE layers with the same checkpoint names as the local ones"),
    )
    for flag, given, what_to_do in stops:
        if given:
            raise ValueError(f"{flag} is not supported: {what_to_do}")
