"""Offloading benchmark (one GPU; a tiny CPU smoke run)."""
