"""Talk to a DSPARK-speculating SGLang server through the OpenAI API.

    python examples/openai_client.py                          # starts the tiny server itself
    python examples/openai_client.py --base-url http://127.0.0.1:30000/v1   # an already running one
                                                              # (e.g. examples/launch_server.sh)

Sends one chat completion, one text completion and one streamed chat completion (greedy), and
prints them. Without --base-url it launches the bundled tiny model with
``sglang_dspark_plugin.harness.serving`` (own process group, stopped at the end).
"""

import argparse
import contextlib
import sys
import time

from openai import OpenAI


def run(base_url: str, prompt: str, max_tokens: int) -> None:
    client = OpenAI(base_url=base_url, api_key="EMPTY", timeout=600)
    model = client.models.list().data[0].id
    print(f"model: {model}")

    t0 = time.monotonic()
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
    )
    print(f"chat ({time.monotonic() - t0:.1f} s): {chat.choices[0].message.content!r}")

    t0 = time.monotonic()
    text = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
    print(f"completion ({time.monotonic() - t0:.1f} s): {text.choices[0].text!r}")

    print("streamed chat: ", end="", flush=True)
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
    )
    pieces = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()
    assert "".join(pieces) == chat.choices[0].message.content, "streamed != non-streamed"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default=None, help="OpenAI base URL of a running server")
    parser.add_argument("--prompt", default="Write a short poem about the sea.")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        base_url = args.base_url
        if base_url is None:
            from sglang_dspark_plugin.harness.serving import SGLangServer, tiny_model_args

            server = stack.enter_context(SGLangServer(tiny_model_args(gamma=3)))
            base_url = server.base_url + "/v1"
        run(base_url, args.prompt, args.max_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
