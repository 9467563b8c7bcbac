"""Mixture-of-Experts: the router, the token dispatchers, the experts and the MoE layer that combines them."""
