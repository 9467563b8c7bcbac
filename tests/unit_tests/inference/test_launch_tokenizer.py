"""A generation program's tokenizer: the one `initialize_megatron()` built in `run_with_megatron`, not a second."""

import os
from unittest import mock

from megatron.inference import launch
from megatron.training import global_vars
from megatron.training import tokenizer as tokenizer_module

LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
MODEL = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
         "--tokenizer-type NullTokenizer --vocab-size 128")


def test_build_tokenizer_returns_the_one_initialize_megatron_built(capsys):
    builds = []
    build = tokenizer_module.build_tokenizer_from_args

    def counted_build(args):
        builds.append(args)
        return build(args)

    def generation(args):
        return launch.build_tokenizer(args), global_vars.get_tokenizer(), args.padded_vocab_size

    launcher_free = {key: value for key, value in os.environ.items() if key not in LAUNCH_VARIABLES}
    with mock.patch.dict(os.environ, launcher_free, clear=True), \
            mock.patch.object(tokenizer_module, "build_tokenizer_from_args", counted_build):
        tokenizer, global_tokenizer, rows = launch.run_with_megatron(None, generation, MODEL.split())
    assert len(builds) == 1 and tokenizer is global_tokenizer
    assert (tokenizer.vocab_size, rows) == (129, 256)
    printed = capsys.readouterr().out
    assert printed.count(" > padded vocab (size: 129) with 127 dummy tokens (new size: 256)\n") == 1
    global_vars.unset_global_variables()
