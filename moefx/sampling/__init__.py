"""Sync-free sampling for moefx: the static-shape sampler, the deferred stop check, and their FX helpers."""
