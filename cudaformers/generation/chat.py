"""`cudaformers chat [MODEL]`: an interactive chat, the reply streamed as it is generated.

Type /reset to start over, /exit (or Ctrl-D) to leave. ``--once TEXT`` answers one message and exits.
"""

from __future__ import annotations

import sys

from .cli import add_model_arguments, generation_kwargs, load


def add_arguments(parser) -> None:
    parser.add_argument("model", nargs="?", default=None, help="model folder, .gguf file or Hub repo id "
                        "(default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--system", default=None, help="a system message")
    parser.add_argument("--once", default=None, metavar="TEXT", help="answer TEXT and exit")
    add_model_arguments(parser)


def reply(model, tok, messages, gen_kwargs, out=sys.stdout) -> str:
    """Generates the assistant's answer to ``messages``, streaming it to ``out``; returns the text."""
    from .streamer import TextStreamer

    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    enc = tok(text, return_tensors="pt", add_special_tokens=False)
    pieces = []

    class Collect(TextStreamer):
        def on_text(self, piece, stream_end=False):
            pieces.append(piece)
            super().on_text(piece, stream_end)

    model.generate(enc["input_ids"], attention_mask=enc["attention_mask"],
                   streamer=Collect(tok, skip_prompt=True, file=out), **gen_kwargs)
    return "".join(pieces).strip()


def run(args) -> int:
    model, tok = load(args.model, args)
    gen_kwargs = generation_kwargs(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    if args.once is not None:
        reply(model, tok, messages + [{"role": "user", "content": args.once}], gen_kwargs)
        return 0
    print("Chat with the model. /reset starts over, /exit leaves.", file=sys.stderr)
    while True:
        try:
            user = input("> ").strip()
        except EOFError:
            print(file=sys.stderr)
            return 0
        if user in ("/exit", "/quit"):
            return 0
        if user == "/reset":
            messages = messages[:1] if args.system else []
            continue
        if not user:
            continue
        messages.append({"role": "user", "content": user})
        messages.append({"role": "assistant", "content": reply(model, tok, messages, gen_kwargs)})
