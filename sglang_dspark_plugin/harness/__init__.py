"""Harness around the plugin: the demo (the README's main job), the server launcher, the tiny test
models and the CPU-only support. The product (plugin, backend, layout, commit, kernels, settings)
never imports from here (tests/test_plugin.py checks it); the demo, the examples, the tests and the
benchmarks do. The CPU-only support reaches SGLang's processes through its own entry point."""
