"""Shared infrastructure: CLI, config loader, model presets, token scoring and artifact I/O."""
