"""The main job: serve the bundled tiny Kimi-Linear with ``--attention-backend dspark`` and DSPARK
speculative decoding, answer one OpenAI ``chat.completions`` request, print it, stop.

    python -m sglang_dspark_plugin.harness.demo [--gamma 3] [--prompt "..."] [--max-tokens 16]

Steps: write the tiny models' weights if missing (``tiny_models.py``); start
``python -m sglang.launch_server --attention-backend dspark --speculative-algorithm DSPARK
--speculative-dspark-block-size <gamma> ...`` (on a machine without a GPU: on CPU under the
Triton interpreter, see ``serving.py``), printing progress while it starts; send one
``chat.completions`` request with the ``openai`` client (greedy); replay the same prompt through
SGLang's native ``/generate`` to show the speculation statistics of that request (verify steps,
accepted drafts, accept length) and check it produced the same tokens; stop the server.
Exit code 0 on success, 1 on any failure (the server is stopped either way).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import List, Optional

from .serving import SGLangServer, ServerStartError, tiny_model_args
from .tiny_models import TARGET_DIR, default_out_dir

DEFAULT_PROMPT = "Tell me a story about a robot who learned to paint."


def _say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def _chat_prompt_ids(model_dir: str, prompt: str) -> List[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
    )
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in newer transformers
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def run(
    *,
    gamma: Optional[int],
    prompt: str,
    max_tokens: int,
    attention_backend: str,
    models_dir: Optional[str],
    extra_args: List[str],
) -> int:
    t_start = time.monotonic()
    models_dir = models_dir or str(default_out_dir())
    args = tiny_model_args(
        gamma, attention_backend=attention_backend, models_dir=models_dir, extra=extra_args
    )
    mode = f"DSPARK speculation, block size {gamma}" if gamma else "no speculation"
    _say(f"model: {models_dir}/{TARGET_DIR} ({mode}, --attention-backend {attention_backend})")

    with SGLangServer(args, name="sglang") as server:
        from openai import OpenAI

        client = OpenAI(base_url=server.base_url + "/v1", api_key="EMPTY", timeout=600)
        model = client.models.list().data[0].id
        _say(f"chat.completions request: {prompt!r} (max_tokens={max_tokens}, temperature=0)")
        t0 = time.monotonic()
        resp = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=max_tokens,
            temperature=0,
        )
        elapsed = time.monotonic() - t0
        answer = resp.choices[0].message.content
        usage = resp.usage
        _say(
            f"answer ({usage.completion_tokens} tokens in {elapsed:.1f} s, "
            f"finish_reason={resp.choices[0].finish_reason}): {answer!r}"
        )

        if gamma:
            # chat.completions responses carry no speculation fields: replay the same prompt
            # through /generate, whose meta_info has them, and check the tokens agree.
            ids = _chat_prompt_ids(f"{models_dir}/{TARGET_DIR}", prompt)
            out = server.post_json(
                "/generate",
                {
                    "input_ids": ids,
                    "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0},
                },
            )
            meta = out["meta_info"]
            same = out["text"] == answer
            _say(
                "speculation (same prompt via /generate): "
                f"{meta.get('spec_verify_ct')} verify steps for {meta.get('completion_tokens')} "
                f"tokens, accept length {meta.get('spec_accept_length', 0):.2f} tokens/step "
                f"(bonus token included), accepted drafts {meta.get('spec_num_correct_drafts')}"
                f"/{meta.get('spec_num_proposed_drafts')}, accepted-drafts histogram "
                f"{meta.get('spec_correct_drafts_histogram')} (index = drafts accepted in a step)"
            )
            if not same:
                _say(f"ERROR: /generate replay differs from the chat answer: {out['text']!r}")
                return 1
    _say(f"done in {time.monotonic() - t_start:.0f} s")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sglang_dspark_plugin.harness.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gamma", type=int, default=3, help="DSPARK block size (drafts per step); 0 = no speculation")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--attention-backend", default="dspark")
    parser.add_argument("--models-dir", default=None, help="where the tiny models live (default: the checkout's configs/)")
    parser.add_argument("extra", nargs="*", help="extra launch_server flags, after --")
    args = parser.parse_args(argv)
    try:
        return run(
            gamma=args.gamma or None,
            prompt=args.prompt,
            max_tokens=args.max_tokens,
            attention_backend=args.attention_backend,
            models_dir=args.models_dir,
            extra_args=args.extra,
        )
    except ServerStartError as exc:
        _say(f"FAILED: the server did not start: {exc}")
    except KeyboardInterrupt:
        _say("interrupted")
    except Exception as exc:  # noqa: BLE001 - report, exit non-zero; the server is already stopped
        _say(f"FAILED: {type(exc).__name__}: {exc}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
