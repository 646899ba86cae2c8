"""Prints tokens as they are generated from a cached export (``attn-export ... --with-past``):
greedy decoding with the key/value cache, one token per step, through ONNX Runtime (a plain
loop over the file's inputs and outputs, named by its cache contract) or through ONNX Runtime
GenAI's generator (with the ``genai_config.json`` that ``--genai-config`` wrote beside it).

    attn-export DIR --to onnx --with-past --genai-config -o out/model.onnx
    python scripts/stream_generate.py out/model.onnx --tokenizer DIR --prompt "Once upon a time"
    python scripts/stream_generate.py out/model.onnx --runtime genai --prompt-ids 5,17,42

With ``--tokenizer`` (a folder ``transformers.AutoTokenizer`` reads: the one the model was saved
to) the text is printed as it grows; without it, the token ids. Exit 0, or 2 with one line on a
usage error (no cache in the file, no genai_config.json, no prompt).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Iterator, List, Optional

import numpy as np


def onnxruntime_tokens(onnx_path: Path, prompt: List[int], new_tokens: int, threads: int = 2) -> Iterator[int]:
    """Greedy tokens from ONNX Runtime, one per step: the prompt prefilled with an empty past,
    then each token fed back with the presents of the step before."""
    import onnx
    import onnxruntime as ort

    from attn_export.cache_contract import ATTENTION_MASK, INPUT_IDS, LOGITS, POSITION_IDS, CacheContract

    contract = CacheContract.require(onnx.load(str(onnx_path), load_external_data=False), onnx_path)
    if contract.encoder_decoder:
        raise ValueError(f"{onnx_path} is the decoder of an encoder-decoder pair: this example streams decoder-only models")
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
    past = {name: t.numpy() for name, t in contract.empty_past(1).items()}
    ids, length = np.asarray([prompt], dtype=np.int64), len(prompt)
    for _ in range(new_tokens):
        feed = {INPUT_IDS: ids, ATTENTION_MASK: np.ones((1, length), dtype=np.int64), **past}
        if contract.position_ids:
            feed[POSITION_IDS] = np.arange(length - ids.shape[1], length, dtype=np.int64)[None]
        outputs = dict(zip(contract.output_names(), session.run(contract.output_names(), feed)))
        token = int(outputs[LOGITS][0, -1].argmax())
        yield token
        past = {contract.past_of(name): value for name, value in outputs.items() if contract.is_present(name)}
        ids, length = np.asarray([[token]], dtype=np.int64), length + 1


def genai_tokens(onnx_path: Path, prompt: List[int], new_tokens: int) -> Iterator[int]:
    """Greedy tokens from ONNX Runtime GenAI's generator (the config beside the file)."""
    import onnxruntime_genai as og

    if not (onnx_path.parent / "genai_config.json").is_file():
        raise ValueError(f"no genai_config.json beside {onnx_path}: export with --genai-config")
    model = og.Model(str(onnx_path.parent))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + new_tokens, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(np.asarray([prompt], dtype=np.int32))
    while not generator.is_done():
        generator.generate_next_token()
        yield int(generator.get_next_tokens()[0])


RUNTIMES = {"onnxruntime": onnxruntime_tokens, "genai": genai_tokens}


def stream(tokens: Iterator[int], tokenizer=None) -> List[int]:
    """Prints each token as it comes: the text it adds (a token can complete a character that
    the one before began), or its id without a tokenizer; stops after the tokenizer's
    end-of-sequence token (GenAI's generator stops there itself)."""
    generated: List[int] = []
    shown = ""
    for token in tokens:
        generated.append(token)
        if tokenizer is None:
            print(token, end=" ", flush=True)
            continue
        text = tokenizer.decode(generated, skip_special_tokens=True)
        print(text[len(shown):], end="", flush=True)
        shown = text
        if token == tokenizer.eos_token_id:
            break
    print()
    return generated


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("onnx", type=Path, help="a cached export (attn-export --with-past)")
    parser.add_argument("--runtime", choices=sorted(RUNTIMES), default="onnxruntime")
    parser.add_argument("--prompt", help="the prompt's text (needs --tokenizer)")
    parser.add_argument("--prompt-ids", help="the prompt's token ids, comma-separated")
    parser.add_argument("--tokenizer", type=Path, help="the folder the model and its tokenizer were saved to")
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    try:
        tokenizer = None
        if args.tokenizer is not None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer))
        if args.prompt_ids:
            prompt = [int(t) for t in args.prompt_ids.split(",")]
        elif args.prompt is not None and tokenizer is not None:
            prompt = tokenizer(args.prompt)["input_ids"]
        else:
            raise ValueError("give --prompt-ids, or --prompt with --tokenizer")
        if not prompt:
            raise ValueError("the prompt has no tokens")
        stream(RUNTIMES[args.runtime](args.onnx, prompt, args.new_tokens), tokenizer)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
