"""Trainer -> engine weight sync: the plan (coverage proof), the in-place copy, verification, the transports."""
