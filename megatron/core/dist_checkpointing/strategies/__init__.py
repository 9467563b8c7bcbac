"""Upstream's save/load strategy names for the torch_dist format (torch.distributed.checkpoint)."""
