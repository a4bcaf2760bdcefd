"""Sharding: meshes, placements, per-op rules, plans, propagation and resharding."""
