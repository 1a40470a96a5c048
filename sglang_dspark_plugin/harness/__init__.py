"""Harness around the plugin: the demo (the README's main job), the server launcher, the tiny test
models and the CPU-only support. The backend never imports from here; the demo, the examples, the
tests and the benchmarks do."""
