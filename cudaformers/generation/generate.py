"""``model.generate()``: batched prompts (left-padded like transformers), a static KV cache, decode
steps and their sampling replayed from one CUDA graph on GPUs (``loop.py``).

On the CPU rows run without padding (varlen prefill), so each row's tokens equal what it gets alone;
on a GPU the prompt pass pads each row at its end to a shared width (``prefill.py``), which never
changes a real token's result.
"""

from __future__ import annotations

import logging

import torch

from .config import GenerationConfig
from .decode import get_runner
from .logits import SamplingTensors
from .loop import LoopKind, LoopState, advance, close_finished, run_loop
from .prefill import prompt_width

logger = logging.getLogger("cudaformers")


def resolve_config(model, generation_config, kwargs) -> GenerationConfig:
    gen = (generation_config or model.generation_config or GenerationConfig()).copy()
    known = set(GenerationConfig().to_dict())
    unknown = sorted(k for k in kwargs if k not in known)
    if unknown:
        raise TypeError(f"generate() got unsupported arguments {unknown}; supported: {sorted(known)}")
    gen.update(**kwargs)
    gen.validate()
    return gen


def prompt_rows(input_ids, attention_mask, pad_token_id, eos_ids):
    """The prompts as token-id tensors without padding."""
    if attention_mask is None:
        if pad_token_id is not None and pad_token_id not in eos_ids and (input_ids == pad_token_id).any():
            attention_mask = input_ids != pad_token_id  # transformers infers the mask the same way
        else:
            return [row for row in input_ids]
    mask = attention_mask.to(input_ids.device).bool()
    return [row[m] for row, m in zip(input_ids, mask)]


def prepare_prompts(model, input_ids, attention_mask, gen: GenerationConfig, streamer=None):
    """(input_ids [B, S] on the model's device, rows without padding, pad id, eos ids, max new tokens),
    with num_return_sequences expanded and bad input rejected."""
    if input_ids is None:
        raise ValueError("generate() needs input_ids (tokenize the prompt first)")
    input_ids = input_ids.to(model.device)
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    eos_ids = gen.eos_token_ids
    pad = gen.pad_token_id if gen.pad_token_id is not None else (eos_ids[0] if eos_ids else 0)
    rows = prompt_rows(input_ids, attention_mask, gen.pad_token_id, eos_ids)
    if any(len(r) == 0 for r in rows):
        raise ValueError("generate() got an empty prompt row; every row needs at least one token")
    n_ret = gen.num_return_sequences
    if n_ret > 1:
        if not gen.do_sample:
            raise ValueError("num_return_sequences > 1 needs do_sample=True (greedy rows would be identical)")
        rows = [r for r in rows for _ in range(n_ret)]
        input_ids = input_ids.repeat_interleave(n_ret, 0)
    if streamer is not None and len(rows) > 1:
        raise ValueError("a streamer needs a single prompt (batch size 1)")
    max_new = gen.max_new_tokens if gen.max_new_tokens is not None else max(gen.max_length - input_ids.shape[1], 0)
    return input_ids, rows, pad, eos_ids, max_new


def sampling_state(model, gen: GenerationConfig, rows, eos_ids):
    """(sampling tensors, seen-token mask for the repetition penalty or None, generator, eos tensor)."""
    dev, n = model.device, len(rows)
    st = SamplingTensors.build([sampling_row(gen)] * n, dev)
    seen = None
    if st.use_penalty:
        seen = torch.zeros(n, model.config.vocab_size, dtype=torch.bool, device=dev)
        for i, r in enumerate(rows):
            seen[i, r] = True
    generator = torch.Generator(device=dev).manual_seed(gen.seed) if gen.seed is not None else None
    return st, seen, generator, torch.tensor(eos_ids or [-1], device=dev)


def generate(model, input_ids, attention_mask=None, generation_config=None, streamer=None, tokenizer=None,
             use_cuda_graph: bool | None = None, **kwargs):
    gen = resolve_config(model, generation_config, kwargs)
    input_ids, rows, pad, eos_ids, max_new = prepare_prompts(model, input_ids, attention_mask, gen, streamer)
    if max_new <= 0:
        return input_ids
    lens = [len(r) for r in rows]
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit and max(lens) + max_new > limit and getattr(model.config, "rope", {}).get("rope_type") != "dynamic":
        logger.warning("prompt + max_new_tokens = %d exceeds max_position_embeddings = %d; quality may degrade",
                       max(lens) + max_new, limit)
    if gen.stop_strings and tokenizer is None:
        raise ValueError("stop_strings needs the tokenizer: generate(..., stop_strings=[...], tokenizer=tok)")

    dev = model.device
    n = len(rows)
    runner = get_runner(model, n, max(max(lens) + max_new, prompt_width(lens)), use_cuda_graph)
    st, seen, generator, eos = sampling_state(model, gen, rows, eos_ids)
    state, step = runner.loop(loop_kind(gen, st, len(eos_ids)), generator)  # may capture: before the prompt's cache
    # The loop's buffers are filled before the prompt pass (the pass does not read them): their host
    # reads and copies then wait on an idle GPU, and from the prompt on the host never waits.
    state.start(st, seen, eos, pad, gen.min_new_tokens, max_new, torch.tensor(lens, device=dev))
    logits = runner.prompt(rows)
    generated = run_loop(logits, step, state, max_new, generator,
                         token_callback(state, gen, input_ids, streamer, tokenizer))
    if streamer is not None:
        streamer.end()
    return torch.cat([input_ids, generated], dim=1)


def loop_kind(gen: GenerationConfig, st: SamplingTensors, num_eos: int) -> LoopKind:
    return LoopKind.of(st, min_new=bool(gen.min_new_tokens) and num_eos > 0, num_eos=num_eos)


def token_callback(state: LoopState, gen: GenerationConfig, input_ids, streamer=None, tokenizer=None):
    """What runs on the host after each step (streaming, stop strings), or None: then the host only
    checks for the end every few steps."""
    if streamer is None and not gen.stop_strings:
        return None
    if streamer is not None:
        streamer.put(input_ids.cpu())

    def on_token(i: int) -> None:
        if streamer is not None:
            streamer.put(state.tokens.cpu())
        if gen.stop_strings:
            _mark_stop_strings(tokenizer, state.out[:, : i + 1], gen.stop_strings, state.finished)
            close_finished(state, i + 1)
    return on_token


def decode_loop(logits, step_fn, gen: GenerationConfig, st, seen, generator, eos, pad: int, max_new: int,
                input_ids, streamer=None, tokenizer=None) -> torch.Tensor:
    """Eager decode loop for models without a ``DecodeRunner`` (recurrent ones): up to ``max_new``
    tokens per row from the first ``logits [B, V]``; ``step_fn(tokens [B])`` runs the model on the
    last tokens and returns the next logits. Returns the generated tokens ``[B, <= max_new]``."""
    rows, vocab = logits.shape
    state = LoopState(loop_kind(gen, st, int((eos >= 0).sum())), rows, max_new, vocab, logits.device)
    state.start(st, seen, eos, pad, gen.min_new_tokens, max_new, torch.zeros(rows, dtype=torch.long, device=logits.device))

    def step():
        advance(step_fn(state.tokens), state, generator)

    generated = run_loop(logits, step, state, max_new, generator,
                         token_callback(state, gen, input_ids, streamer, tokenizer))
    if streamer is not None:
        streamer.end()
    return generated


def sampling_row(gen: GenerationConfig) -> dict:
    if not gen.do_sample:
        return dict(temperature=0.0, repetition_penalty=gen.repetition_penalty)
    return dict(temperature=gen.temperature if gen.temperature is not None else 1.0, top_k=gen.top_k,
                top_p=gen.top_p, min_p=gen.min_p, repetition_penalty=gen.repetition_penalty)


def _mark_stop_strings(tokenizer, generated, stop_strings, finished) -> None:
    """Marks rows whose decoded output contains a stop string as finished (a host read per step)."""
    texts = tokenizer.batch_decode(generated.tolist(), skip_special_tokens=True)
    finished |= torch.tensor([any(s in t for s in stop_strings) for t in texts], device=finished.device)
