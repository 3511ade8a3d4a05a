"""Transforms that rewrite a Step into a collective-aware Step."""
