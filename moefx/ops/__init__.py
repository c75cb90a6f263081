"""torch.library custom ops that moefx passes and backends emit."""
