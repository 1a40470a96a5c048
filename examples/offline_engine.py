"""Offline (in-process) generation with SGLang's ``Engine``: the bundled tiny Kimi-Linear with the
plugin's attention backend and DSPARK speculation, no HTTP server.

    python examples/offline_engine.py [--gamma 3] [--max-tokens 16]

Prints each completion with its speculation statistics (verify steps, accept length), then shuts
the engine down. Without a GPU it runs on CPU under the Triton interpreter, with the same flags
as the server (``sglang_dspark_plugin.harness.serving.cpu_flags``).
"""

import argparse
import sys

PROMPTS = ["The quick brown fox", "Once upon a time", "Write a short poem about the sea."]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gamma", type=int, default=3, help="DSPARK block size")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()

    from sglang_dspark_plugin.harness.serving import tiny_engine_kwargs, tiny_model_args

    # without a GPU this also sets the CPU environment, which the engine's processes inherit
    kwargs = tiny_engine_kwargs(tiny_model_args(args.gamma, attention_backend="dspark"))

    import sglang

    engine = sglang.Engine(**kwargs)
    try:
        outputs = engine.generate(
            prompt=PROMPTS, sampling_params={"max_new_tokens": args.max_tokens, "temperature": 0}
        )
        for prompt, out in zip(PROMPTS, outputs):
            meta = out["meta_info"]
            print(f"{prompt!r} -> {out['text']!r}")
            print(
                f"    {meta['completion_tokens']} tokens in {meta.get('spec_verify_ct')} verify "
                f"steps, accept length {meta.get('spec_accept_length', 0):.2f}, accepted-drafts "
                f"histogram {meta.get('spec_correct_drafts_histogram')}"
            )
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":  # the Engine spawns processes: keep the guard
    sys.exit(main())
