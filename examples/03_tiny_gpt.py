"""A tiny character-level GPT on a text corpus, trained across uneven devices, then sampled.

    python examples/03_tiny_gpt.py                      # Python's stdlib sources as the corpus
    python examples/03_tiny_gpt.py --text corpus.txt    # your own text file (or a directory)
    python examples/03_tiny_gpt.py --smoke              # a tiny corpus and model (CI)

The corpus becomes windows of --block characters (input = window, target = the window shifted
by one). The stopping rule is a loss target (time-to-loss: the language-model analogue of TTA);
"accuracy" is next-character accuracy. After training the global model comes back in
`result.model` and writes a short sample.
"""

from __future__ import annotations

import argparse
import functools

import torch

import hetrain
from hetrain.workloads import MODELS
from hetrain.workloads.text import decode, text


@torch.no_grad()
def sample(model: torch.nn.Module, vocab: str | None, prompt: str, n: int, block: int) -> str:
    """Greedy-free sampling (temperature 1) of n characters after `prompt`."""
    model.eval()
    to_id = {c: i for i, c in enumerate(vocab)} if vocab else None
    ids = [to_id.get(c, 0) for c in prompt] if to_id else list(prompt.encode())
    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        x = torch.tensor([ids[-block:]])
        probs = torch.softmax(model(x)[0, -1], dim=-1)
        ids.append(int(torch.multinomial(probs, 1, generator=g)))
    return decode(ids, vocab)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", help="text file or directory (default: the stdlib's .py files)")
    ap.add_argument("--chars", type=int, default=300_000, help="read at most this many chars")
    ap.add_argument("--block", type=int, default=64, help="context length")
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--target-loss", type=float, default=None,
                    help="stop at this test loss (default 2.0; 3.0 with --smoke)")
    ap.add_argument("--cluster", default="hetero-4")
    ap.add_argument("--strategy", default="cadp")
    ap.add_argument("--engine", default="sim", choices=("sim", "dist"))
    ap.add_argument("--smoke", action="store_true", help="a tiny corpus and model (CI)")
    args = ap.parse_args()
    torch.set_num_threads(1)

    chars, block = (20_000, 16) if args.smoke else (args.chars, args.block)
    target = args.target_loss if args.target_loss is not None else (3.0 if args.smoke else 2.0)
    train_set, test_set, meta = text(paths=args.text, max_chars=chars, block_size=block)
    model = functools.partial(MODELS["gpt"], (block,), meta["num_classes"],
                              n_layer=1 if args.smoke else 2, n_embd=32 if args.smoke else 64)
    print(f"corpus: {len(meta['files'])} file(s), {len(train_set)} training windows of "
          f"{block} chars, vocabulary {meta['num_classes']}")
    r = hetrain.train(
        model=model, dataset=train_set, test_dataset=test_set, task="language_model",
        optimizer={"name": "adamw", "lr": 3e-3},
        cluster=args.cluster, strategy=args.strategy, engine=args.engine,
        batch_size=16, max_epochs=5.0 if args.smoke else args.epochs,
        target_loss=target, name="tiny-gpt", progress=not args.smoke)
    s = r.summary
    print(f"test loss {s['final_loss']:.3f} nats/char, next-char accuracy "
          f"{s['final_accuracy']:.3f}, {s['time_s']:.2f} s ({s['engine']}), time to loss "
          f"{target}: " + (f"{s['tta_s']:.2f} s" if s["tta_s"] is not None else
                                     f"not reached in {s['epochs']:.2f} epochs (more "
                                     "--epochs, or a higher --target-loss)"))
    if r.model is not None:
        print("sample:", repr(sample(r.model, meta["vocab"], "def ", 40 if args.smoke else 200,
                                     block)))


if __name__ == "__main__":
    main()
