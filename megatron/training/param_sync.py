"""Wait for the parameter gathers a data-parallel wrapper started after the optimizer step
(`--overlap-param-gather`): until they land, a rank's copy of the weights other ranks own still holds the values
before the step. Anything that reads the weights outside a forward (a checkpoint save, the weight-hash check)
waits here first, as upstream forces the parameter sync before saving."""


def finish_param_syncs(model_chunks):
    """Let every chunk's post-step gathers in flight land (a no-op for wrappers without any)."""
    for chunk in model_chunks:
        finish_param_sync = getattr(chunk, "finish_param_sync", None)
        if finish_param_sync is not None:
            finish_param_sync()
