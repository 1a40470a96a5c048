"""Offline (in-process) generation with SGLang's ``Engine``: the bundled tiny Kimi-Linear with the
plugin's attention backend and DSPARK speculation, no HTTP server.

    python examples/offline_engine.py [--gamma 3] [--max-tokens 16]

Prints each completion with its speculation statistics (verify steps, accept length), then shuts
the engine down. Without a GPU it runs on CPU under the Triton interpreter, with the same flags
as the server (``sglang_dspark_plugin.harness.serving.cpu_flags``).
"""

import argparse
import os
import sys

PROMPTS = ["The quick brown fox", "Once upon a time", "Write a short poem about the sea."]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gamma", type=int, default=3, help="DSPARK block size")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()

    import torch

    from sglang_dspark_plugin.harness.serving import cpu_env, cpu_flags, engine_kwargs, tiny_model_args

    flags = tiny_model_args(args.gamma, attention_backend="dspark")
    if not torch.cuda.is_available():
        # The engine's scheduler process inherits this environment: Triton's interpreter must be
        # on before it defines any kernel.
        os.environ.update(cpu_env())
        flags += cpu_flags(speculative=True)
    kwargs = engine_kwargs(flags)
    kwargs.pop("skip_server_warmup", None)  # an HTTP-server option; the Engine has no warmup

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
