"""Per-parameter optimizer steps for full fine-tuning, run inside backward.

Why per parameter: the step for a weight runs as soon as its gradient is complete (train/
in_backward.py calls `step_param` from a post-accumulate-grad hook), while a streamed block's
weights are on the device, and the gradient is freed right after, so the gradients of the whole
model never exist at once. A torch optimizer steps all its parameters together; here each
parameter carries its own state.

Where the state lives: in a small `ParamState` module registered as a child of the module that
owns the weight (`<module>.<attr>_optstate`), with non-persistent buffers. The memory engine then
treats the state like the weights it belongs to: a resident block's state is placed on the device
with it, a streamed block's state is packed into the block's host buffer and travels with the
weights in the same copy (and back, updated). It never appears in the model's state_dict.

The math: `sgd` on fp32 weights is torch's single-tensor SGD operation for operation; `adamw` on
fp32 weights with fp32 state is torch's single-tensor AdamW on a device and torch's fused CPU
kernel on the host (so the fused loop is bitwise equal to `backward(); opt.step()` with
`AdamW(fused=True)` on CPU); every other host step runs the host kernels (`_host_step`,
train/host_kernels.py: one pass per element, within stated tolerances of the torch-op path);
`adafactor` is torch's Adafactor (factored second moment: a row and a column vector per matrix):
operation for operation on a device (and wherever `host_kernels=False`), and on the host for a
2-D weight the kernels' three passes, fp32 weights included, within a stated tolerance of torch's
Adafactor (tests/test_host_kernels.py: 5e-5 of the weights' displacement over 100 steps).
bf16 weights are updated in fp32 and written back with stochastic rounding (an update smaller than
bf16's spacing moves the weight with the right probability instead of vanishing); bf16 AdamW
moments (`state_dtype = "bf16"`) likewise. Optional fp32 master weights stay in host RAM (pageable:
on CUDA the copy back after each weight's step waits for the device, once per weight).
`adamw8bit` delegates to bitsandbytes (CUDA only; its state stays on the device).

No step reads a device value on the host: inside backward such a read (`.item()`) waits for every
queued kernel, once per weight. Adafactor's two norms stay 0-dim device tensors off the CPU (on the
CPU they are read as torch's Adafactor reads them, which keeps the fused loop bitwise equal to it),
and bitsandbytes' per-parameter update is called without its `step()`, which synchronizes the
device after every parameter.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

from . import host_kernels

STATE_SUFFIX = "_optstate"


def clip_in_place(g: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Scale g to norm <= max_norm (per-parameter clipping), in place: bitwise `g * coef`, without
    a second gradient-sized tensor. No host read of the norm (the coefficient stays a tensor)."""
    norm = torch.linalg.vector_norm(g.detach().float())
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    return g.mul_(coef.to(g.dtype))


def _clip_norm(grad: torch.Tensor, given: float | None) -> float:
    """The clipping norm of a host gradient: `given` where the device took it; else the kernels' sum
    of squares (fp32 blocks summed in double: half the time of torch's vector_norm here, 8 against
    16 ms for 37.7 M elements, and nearer the exact norm); else torch's."""
    if given is not None:
        return given
    if host_kernels.library() is not None:
        return host_kernels.sumsq(grad) ** 0.5
    return float(torch.linalg.vector_norm(grad))


def _host_scalars(t: torch.Tensor) -> bool:
    """Whether a step may read reductions of `t` on the host: free on the CPU, a device-wide wait
    anywhere else (see the module docstring)."""
    return t.device.type == "cpu"


def stochastic_round_to_bf16(x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """fp32 -> bf16, rounding up with probability equal to the discarded fraction (unbiased).

    Adds a uniform random 16-bit integer to the fp32 bit pattern and truncates the low 16 bits: the
    bit pattern of a float is monotone in its magnitude, so the carry lands exactly when the
    discarded fraction plus the noise reaches one bf16 step.
    """
    x = x.to(torch.float32).contiguous()
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    bits = (x.view(torch.int32) + noise) & -65536
    return bits.view(torch.float32).to(torch.bfloat16)


def _on_simulated_host(t: torch.Tensor) -> bool:
    from ..memory.simulated import HOST

    return t.device.type != "cpu" and str(t.device) == HOST


class ParamState(nn.Module):
    """The optimizer state of one weight, as non-persistent buffers (see the module docstring)."""

    holds_optimizer_state = True        # memory/streaming_units.OPTIMIZER_STATE_ATTR: may stay on the host

    def __init__(self, tensors: dict[str, torch.Tensor]):
        super().__init__()
        for k, v in tensors.items():
            self.register_buffer(k, v, persistent=False)

    def tensors(self) -> dict[str, torch.Tensor]:
        return dict(self._buffers)


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    mod_name, _, attr = name.rpartition(".")
    return (model.get_submodule(mod_name) if mod_name else model), attr


def initial_state(kind: str, p: torch.Tensor, state_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Zero state of optimizer `kind` for weight `p` (on p's device)."""
    if kind == "adamw":
        return {"exp_avg": torch.zeros(p.shape, dtype=state_dtype, device=p.device),
                "exp_avg_sq": torch.zeros(p.shape, dtype=state_dtype, device=p.device)}
    if kind == "adafactor":
        if p.dim() > 1:
            row = list(p.shape)
            row[-1] = 1
            col = list(p.shape)
            col[-2] = 1
            return {"row_var": torch.zeros(row, device=p.device), "col_var": torch.zeros(col, device=p.device)}
        return {"variance": torch.zeros(p.shape, device=p.device)}
    if kind in ("sgd", "adamw8bit"):
        return {}
    raise ValueError(f"[train] optimizer: unknown optimizer {kind!r}")


def state_bytes_per_param(kind: str, state_dtype: str = "fp32") -> float:
    """Bytes of optimizer state per trained parameter (Adafactor: ~0 for large matrices)."""
    return {"adamw": 8.0 if state_dtype == "fp32" else 4.0, "adamw8bit": 2.0, "adafactor": 0.0, "sgd": 0.0}[kind]


class FusedOptimizer(torch.optim.Optimizer):
    """Holds the per-parameter state and hyper-parameters; `step_param` updates one weight.

    A torch Optimizer subclass only so LR schedulers drive `param_groups[0]["lr"]`; `step()` ends a
    training step (the updates themselves already ran in backward).
    """

    def __init__(self, model: nn.Module, named: dict[str, nn.Parameter], kind: str, *, lr: float,
                 betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0, state_dtype: str = "fp32",
                 stochastic_rounding: bool = True, master_weights: bool = False, seed: int = 0,
                 host_kernels: bool = True, scheduled: bool = True):
        if scheduled:
            super().__init__(list(named.values()), {"lr": lr})
        else:
            # A measurement (planner/full_model.py) steps through step_param alone, which reads
            # param_groups[0]["lr"] and nothing else of torch's Optimizer. torch's Optimizer.__init__
            # imports torch._dynamo on first use (1.1-1.4 s on a 2-core machine), which a plan would
            # pay for bookkeeping (LR-scheduler and state_dict hooks) it never uses.
            self.defaults = {"lr": lr}
            self.param_groups = [{"params": list(named.values()), "lr": lr}]
        self.use_host_kernels = host_kernels   # False: the torch-op path everywhere (what a device runs)
        self.kind, self.betas, self.eps, self.weight_decay = kind, tuple(betas), eps, weight_decay
        self.state_dtype = torch.bfloat16 if state_dtype == "bf16" else torch.float32
        self.sr = stochastic_rounding
        self.names = {p: n for n, p in named.items()}
        self.steps: dict[str, int] = {n: 0 for n in named}
        self.holders: dict[str, ParamState] = {}
        self.masters: dict[str, torch.Tensor] = {}
        self.bnb: dict[str, torch.optim.Optimizer] = {}
        self.generators: dict[torch.device, torch.Generator] = {}
        self.seed = seed
        for n, p in named.items():
            owner, attr = _owner(model, n)
            holder = ParamState(initial_state(kind, p, self.state_dtype))
            owner.add_module(attr + STATE_SUFFIX, holder)
            self.holders[n] = holder
            if master_weights and p.dtype != torch.float32:
                self.masters[n] = p.detach().to("cpu", torch.float32, copy=True)
        if kind == "adamw8bit":
            self._check_bnb(named)

    # -- one parameter -------------------------------------------------------------------------------
    def clips_by_given_norm(self) -> bool:
        """Whether a host step clips by a norm handed to it (`step_param(grad_norm=)`): AdamW on the
        host kernels. Adafactor takes its norm from its own first pass and the torch-op path takes
        its own, so for them the device need not take one."""
        return self.use_host_kernels and self.kind == "adamw"

    def step_param(self, p: nn.Parameter, grad: torch.Tensor, weight: torch.Tensor | None = None,
                   lr: float | None = None, max_grad_norm: float = 0.0, grad_norm: float | None = None) -> None:
        """Update `p` with `grad`. `weight`: the tensor to update instead of `p.data` (the host copy
        of a streamed weight whose step runs on the host, memory/trainable_streaming.py); `lr`: the
        learning rate read when the step was issued (a host step may run after the scheduler moved);
        `max_grad_norm` > 0: clip this gradient to that norm first (the step owns `grad` and may
        scale it in place). `grad_norm`: its norm where the device already took it (a host step's
        gradient, memory/trainable_streaming.step_on_host); the host kernels clip by it instead of
        a pass of their own (the torch-op path, bitwise the device step's, takes its own)."""
        name = self.names[p]
        lr = self.param_groups[0]["lr"] if lr is None else lr
        self.steps[name] += 1
        data = p.data if weight is None else weight
        if self.kind != "adamw8bit" and self._host_step(name, data, grad, lr, max_grad_norm, grad_norm):
            return
        if max_grad_norm > 0:
            grad = clip_in_place(grad, max_grad_norm)
        if self.kind == "adamw8bit":
            return self._step_bnb(name, p, grad, lr)
        st = self.holders[name].tensors()
        master = self.masters.get(name)
        exact = data.dtype == torch.float32 and master is None
        w = data if exact else (master.to(data.device, non_blocking=True) if master is not None else data.float())
        g = grad if grad.dtype == w.dtype else grad.to(w.dtype)
        work = {k: (v if v.dtype == torch.float32 else v.float()) for k, v in st.items()}
        with torch.no_grad():
            getattr(self, "_" + self.kind)(w, g, work, self.steps[name], lr)
            for k, v in st.items():
                if v.dtype != torch.float32:
                    v.copy_(self._round(work[k]))
            if exact:
                return
            if master is not None:
                if w is not master:
                    master.copy_(w)
                data.copy_(w)                           # round to nearest from the fp32 master
            elif data.dtype == torch.bfloat16 and self.sr:
                data.copy_(self._round(w))
            else:
                data.copy_(w)

    # -- the host step: library kernels (host_kernels.py module docstring) ------------------------------
    def _host_step(self, name: str, data: torch.Tensor, grad: torch.Tensor, lr: float, max_grad_norm: float,
                   grad_norm: float | None = None) -> bool:
        """The update of a weight held in host memory, at the fused-kernel rate; False where it does
        not apply (a device tensor, a layout or setting the kernels do not cover, no kernels built):
        the torch-op path below runs then.

        fp32 weights with fp32 AdamW moments: torch's fused CPU AdamW (`_fused_adamw_`), bitwise
        torch's `AdamW(fused=True)`. Every other AdamW setting, and Adafactor on 2-D weights (bf16
        or fp32): host_kernels.c, one pass per element in fp32 registers (Adafactor: three).
        Its results differ from the torch-op
        path by the order of fp32 operations (a few ulp of fp32 before rounding to bf16), the
        clipping scale applied in fp32 rather than to a bf16 gradient, and the random bits of
        stochastic rounding (a hash of seed, tensor, step and element instead of torch's
        generator); tests/test_host_kernels.py states the tolerances.

        Why fp32 Adafactor is no longer bitwise torch's here: torch's Adafactor reads four
        reductions (||w||, the row and column norms, ||update||) whose exact bits depend on torch's
        reduction order, and ||update|| needs the whole update materialised first; staying bitwise
        meant torch's dozen passes and a tensor-sized temporary, 0.05 of the fused AdamW rate. The
        kernels sum in their own (fixed) order and stay within 5e-5 of the weights' displacement
        over 100 steps; `host_kernels=False` keeps the bitwise torch-op path."""
        st = self.holders[name].tensors()
        master = self.masters.get(name)
        if self.use_host_kernels and self.kind in ("adamw", "adafactor") and _on_simulated_host(data) \
                and (host_kernels.library() is not None or self.kind == "adamw" and data.dtype == torch.float32
                     and master is None and self.state_dtype == torch.float32):
            # The host RAM of a simulated run (memory/simulated.py) holds storage-less tensors: no
            # values to update, and the step a real host runs here (the kernels below) allocates
            # nothing the size of the tensor, so the simulated step allocates nothing either.
            return True
        if not self.use_host_kernels or self.kind not in ("adamw", "adafactor") or not host_kernels.handles(data, grad, master, *st.values()):
            return False
        if grad.shape != data.shape:
            return False
        fp32_exact = data.dtype == torch.float32 and master is None
        if self.kind == "adafactor" and data.dim() != 2:
            return False
        fused_adamw = self.kind == "adamw" and fp32_exact and grad.dtype == torch.float32 \
            and self.state_dtype == torch.float32
        if not fused_adamw and host_kernels.library() is None:
            return False
        if fused_adamw:
            # Clipping rides in the kernel: it divides the gradient by grad_scale as it reads it.
            scale = None
            if max_grad_norm > 0:
                coef = max_grad_norm / (_clip_norm(grad, grad_norm) + 1e-6)
                scale = torch.tensor(1.0 / coef) if coef < 1.0 else None
            beta1, beta2 = self.betas
            steps = torch.tensor(float(self.steps[name]))
            torch._fused_adamw_([data], [grad], [st["exp_avg"]], [st["exp_avg_sq"]], [], [steps], lr=lr,
                                beta1=beta1, beta2=beta2, weight_decay=self.weight_decay, eps=self.eps,
                                amsgrad=False, maximize=False, grad_scale=scale)
            return True
        step = self.steps[name]
        key = zlib.crc32(f"{self.seed}:{name}:{step}".encode())
        decay = 1 - lr * self.weight_decay
        if self.kind == "adafactor":          # clipping rides in its first pass (the row sums of g^2)
            host_kernels.adafactor_matrix(
                data, grad, st["row_var"], st["col_var"], max_grad_norm=max_grad_norm, one_minus_beta2_t=step ** -0.8,
                rho_t=min(lr, 1 / (step ** 0.5)), decay=decay, eps1=torch.finfo(torch.float32).eps, eps2=1e-3,
                sr_w=self.sr, key=key)
            return True
        gscale = 1.0
        if max_grad_norm > 0:
            gscale = min(max_grad_norm / (_clip_norm(grad, grad_norm) + 1e-6), 1.0)
        beta1, beta2 = self.betas
        return host_kernels.adamw(
            data, master, grad, st["exp_avg"], st["exp_avg_sq"], gscale=gscale, decay=decay, beta1=beta1,
            beta2=beta2, eps=self.eps, step_size=lr / (1 - beta1 ** step), bc2_sqrt=(1 - beta2 ** step) ** 0.5,
            sr_w=self.sr, sr_state=self.sr, key=key)

    def _round(self, x: torch.Tensor) -> torch.Tensor:
        return stochastic_round_to_bf16(x, self._generator(x.device)) if self.sr else x.to(torch.bfloat16)

    def _generator(self, device: torch.device) -> torch.Generator:
        g = self.generators.get(device)
        if g is None:
            g = self.generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return g

    # -- the update rules (in place on fp32 w and state) ---------------------------------------------
    def _sgd(self, w, g, st, step, lr):
        if self.weight_decay:
            w.mul_(1 - lr * self.weight_decay)
        w.add_(g, alpha=-lr)

    def _adamw(self, w, g, st, step, lr):
        """torch's _single_tensor_adam with decoupled weight decay, operation for operation."""
        beta1, beta2 = self.betas
        exp_avg, exp_avg_sq = st["exp_avg"], st["exp_avg_sq"]
        if self.weight_decay != 0:
            w.mul_(1 - lr * self.weight_decay)
        exp_avg.lerp_(g, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        bias_correction1 = 1 - beta1 ** step
        bias_correction2 = 1 - beta2 ** step
        step_size = lr / bias_correction1
        bias_correction2_sqrt = bias_correction2 ** 0.5
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(self.eps)
        w.addcdiv_(exp_avg, denom, value=-step_size)

    def _adafactor(self, w, g, st, step, lr):
        """torch's _single_tensor_adafactor with its defaults (beta2_decay -0.8, eps (None, 1e-3), d 1)."""
        eps1, eps2, d = torch.finfo(w.dtype).eps, 1e-3, 1.0
        one_minus_beta2_t = step ** -0.8
        rho_t = min(lr, 1 / (step ** 0.5))
        on_host = _host_scalars(w)
        if on_host:
            alpha = max(eps2, w.norm(2).item() / (w.numel() ** 0.5)) * rho_t
        else:                                   # 0-dim on the device, computed before weight decay
            alpha = (w.norm(2) / (w.numel() ** 0.5)).clamp_(min=eps2) * rho_t
        if self.weight_decay != 0:
            w.mul_(1 - lr * self.weight_decay)
        if g.dim() > 1:
            row_var, col_var = st["row_var"], st["col_var"]
            row_mean = torch.norm(g, dim=-1, keepdim=True).square_().div_(g.size(-1))
            row_var.lerp_(row_mean, one_minus_beta2_t)
            col_mean = torch.norm(g, dim=-2, keepdim=True).square_().div_(g.size(-2))
            col_var.lerp_(col_mean, one_minus_beta2_t)
            var_estimate = row_var @ col_var
            var_estimate.div_(row_var.mean(dim=-2, keepdim=True).clamp_(min=eps1))
        else:
            variance = st["variance"]
            variance.lerp_(g * g, one_minus_beta2_t)
            var_estimate = variance.clone()
        update = var_estimate.clamp_(min=eps1 * eps1).rsqrt_()
        update.mul_(g)
        if on_host:
            denom = max(1.0, update.norm(2).item() / ((update.numel() ** 0.5) * d))
            w.add_(update, alpha=-alpha / denom)
        else:
            denom = (update.norm(2) / ((update.numel() ** 0.5) * d)).clamp_(min=1.0)
            w.sub_(update.mul_(alpha / denom))

    # -- bitsandbytes 8-bit AdamW (CUDA) -------------------------------------------------------------
    def _check_bnb(self, named) -> None:
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            raise ValueError("[train] optimizer = \"adamw8bit\" needs bitsandbytes: pip install 'leantune[bnb]' "
                             "(CUDA only), or use \"adamw\" with [full] state_dtype = \"bf16\"") from None

    def _step_bnb(self, name, p, grad, lr):
        import bitsandbytes as bnb

        opt = self.bnb.get(name)
        if opt is None:
            opt = self.bnb[name] = bnb.optim.AdamW8bit([p], lr=lr, betas=self.betas, eps=self.eps,
                                                      weight_decay=self.weight_decay)
        group = opt.param_groups[0]
        group["lr"] = lr
        p.grad = grad
        try:
            # Optimizer8bit.step() ends every parameter's update with torch.cuda.synchronize(): called
            # from backward for each weight, that would drain the device once per weight. Its parts
            # are called directly instead (first call: overrides, state onto the weight's device).
            with torch.no_grad():
                if not opt.initialized:
                    opt.check_overrides()
                    opt.to_gpu()
                    opt.initialized = True
                if len(opt.state[p]) == 0:
                    opt.init_state(group, p, 0, 0)
                opt.update_step(group, p, 0, 0)
        finally:
            p.grad = None

    # -- a whole step ----------------------------------------------------------------------------------
    def step(self, closure=None):        # noqa: D401  (torch's signature)
        """End of a training step: nothing left to update (it ran in backward)."""
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    # -- resumable state -------------------------------------------------------------------------------
    def state_tensors(self, name: str) -> dict[str, torch.Tensor]:
        out = dict(self.holders[name].tensors())
        if name in self.masters:
            out["master"] = self.masters[name]
        return out

    def state_dict(self) -> dict:
        """Scalars only; the per-parameter tensors are saved by the mode, block by block."""
        gens = {str(d): g.get_state() for d, g in self.generators.items()}
        bnb = {n: o.state_dict() for n, o in self.bnb.items()}
        return {"kind": self.kind, "steps": dict(self.steps), "generators": gens, "bnb": bnb,
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]}

    def load_state_dict(self, state: dict) -> None:
        if state["kind"] != self.kind:
            raise ValueError(f"the checkpoint was trained with optimizer {state['kind']!r}, this run uses "
                             f"{self.kind!r} ([train] optimizer)")
        self.steps.update(state["steps"])
        for d, s in state["generators"].items():
            self._generator(torch.device(d)).set_state(s)
        for k, v in state["param_groups"][0].items():
            self.param_groups[0][k] = v
        for n, s in state.get("bnb", {}).items():
            p = next(p for p, nm in self.names.items() if nm == n)
            import bitsandbytes as bnb

            opt = self.bnb[n] = bnb.optim.AdamW8bit([p], lr=self.param_groups[0]["lr"], betas=self.betas,
                                                    eps=self.eps, weight_decay=self.weight_decay)
            opt.load_state_dict(s)

    def remove_holders(self, model: nn.Module) -> None:
        """Detach the state modules from the model (at the end of a run)."""
        for n in self.holders:
            owner, attr = _owner(model, n)
            if hasattr(owner, attr + STATE_SUFFIX):
                delattr(owner, attr + STATE_SUFFIX)

