"""Decoder layers compiled once, whatever the depth: a nested region or compiled frames over one layer body."""
