"""Fine-tune a transformers causal LM with zoffload: a plain PyTorch loop, two lines changed.

    python examples/finetune.py                        # GPT-2 small shape, random init, zoffload
    python examples/finetune.py --reference            # the same loop with torch AdamW (fp32 masters)
    python examples/finetune.py --model-name PATH      # a pretrained checkpoint instead

The data is a small synthetic corpus (a few fixed token sequences, sampled with a seeded
generator), so the loss falls quickly and the two runs can be compared step by step. On CUDA the
model is bf16; the reference keeps fp32 master weights on the GPU and runs torch's AdamW on
them, which is what one writes without zoffload. Prints one line per step and a summary.
"""

import argparse
import time

import torch


def build_model(args):
    import transformers

    if args.model_name:
        return transformers.AutoModelForCausalLM.from_pretrained(args.model_name)
    torch.manual_seed(args.seed)
    config = transformers.GPT2Config(n_positions=args.seq, n_layer=args.layers)
    return transformers.GPT2LMHeadModel(config)


def corpus(vocab, seq, batch, steps, seed):
    g = torch.Generator().manual_seed(seed)
    sequences = torch.randint(0, vocab, (8, seq), generator=g)
    for _ in range(steps):
        yield sequences[torch.randint(0, 8, (batch,), generator=g)]


class MasterAdamW:
    """The reference: torch AdamW over fp32 masters of a bf16 model, on the model's device."""

    def __init__(self, params, **kw):
        self.params = list(params)
        self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.opt = torch.optim.AdamW(self.masters, **kw)

    def step(self):
        for m, p in zip(self.masters, self.params):
            m.grad = None if p.grad is None else p.grad.float()
        self.opt.step()
        with torch.no_grad():
            for m, p in zip(self.masters, self.params):
                p.copy_(m.to(p.dtype))

    def zero_grad(self):
        for p in self.params:
            p.grad = None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-name", default="", help="a pretrained model (default: GPT-2 small shape, random)")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config", default=None, help="a DeepSpeed-style JSON config (default: optimizer in host memory)")
    ap.add_argument("--reference", action="store_true", help="torch AdamW with fp32 masters instead of zoffload")
    args = ap.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model(args).to(device)
    if device == "cuda":
        model = model.to(torch.bfloat16)
    model.train()

    if args.reference:
        opt = MasterAdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    else:
        import zoffload.torch                                        # + these two lines

        opt = zoffload.torch.OffloadOptimizer(model.named_parameters(), config=args.config, lr=args.lr)

    vocab = model.config.vocab_size
    losses = []
    start = time.perf_counter()
    for step, tokens in enumerate(corpus(vocab, args.seq, args.batch, args.steps, args.seed)):
        tokens = tokens.to(device)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        print(f"step {step:3d}  loss {losses[-1]:.4f}", flush=True)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    name = "torch AdamW (fp32 masters)" if args.reference else "zoffload"
    print(f"{name}: {args.steps} steps in {seconds:.1f} s, loss {losses[0]:.4f} -> {losses[-1]:.4f}")


if __name__ == "__main__":
    main()
