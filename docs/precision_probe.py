#!/usr/bin/env python3
"""Which libtorch CPU kernels run in float16 and bfloat16 (docs/precision.md).

The project's .venv torch is the libtorch the C++ library links, so this probes
exactly the kernels shardtensor's rules call. Every case runs
forward and backward in each dtype and is compared with float64 on the same
rounded inputs (same seed): "wrong" marks a kernel that returns a result of
another shape or an error above 10% of the largest value.

    OMP_NUM_THREADS=1 .venv/bin/python docs/precision_probe.py
"""
import torch
import torch.nn.functional as F

torch.set_num_threads(1)


def t(*s):
    return torch.randn(*s)


cases = {
 'conv1d': lambda d: F.conv1d(t(1,3,10).to(d).requires_grad_(), t(4,3,3).to(d).requires_grad_()),
 'conv2d': lambda d: F.conv2d(t(1,3,10,10).to(d).requires_grad_(), t(4,3,3,3).to(d).requires_grad_()),
 'conv3d': lambda d: F.conv3d(t(1,3,6,6,6).to(d).requires_grad_(), t(4,3,3,3,3).to(d).requires_grad_()),
 'conv_transpose1d': lambda d: F.conv_transpose1d(t(1,4,10).to(d).requires_grad_(), t(4,4,3).to(d).requires_grad_(), stride=2),
 'conv_transpose2d': lambda d: F.conv_transpose2d(t(1,4,10,10).to(d).requires_grad_(), t(4,4,3,3).to(d).requires_grad_(), stride=2),
 'conv_transpose3d': lambda d: F.conv_transpose3d(t(1,4,6,6,6).to(d).requires_grad_(), t(4,4,3,3,3).to(d).requires_grad_(), stride=2),
 'max_pool1d': lambda d: F.max_pool1d(t(1,3,10).to(d).requires_grad_(), 2),
 'max_pool2d': lambda d: F.max_pool2d(t(1,3,10,10).to(d).requires_grad_(), 2),
 'max_pool3d': lambda d: F.max_pool3d(t(1,3,6,6,6).to(d).requires_grad_(), 2),
 'avg_pool1d': lambda d: F.avg_pool1d(t(1,3,10).to(d).requires_grad_(), 2),
 'avg_pool2d': lambda d: F.avg_pool2d(t(1,3,10,10).to(d).requires_grad_(), 2),
 'avg_pool3d': lambda d: F.avg_pool3d(t(1,3,6,6,6).to(d).requires_grad_(), 2),
 'adaptive_avg_pool2d': lambda d: F.adaptive_avg_pool2d(t(1,3,10,10).to(d).requires_grad_(), 3),
 'adaptive_max_pool2d': lambda d: F.adaptive_max_pool2d(t(1,3,10,10).to(d).requires_grad_(), 3),
 'interp_nearest2d': lambda d: F.interpolate(t(1,3,5,5).to(d).requires_grad_(), scale_factor=2, mode='nearest'),
 'interp_linear1d': lambda d: F.interpolate(t(1,3,5).to(d).requires_grad_(), scale_factor=2, mode='linear', align_corners=False),
 'interp_bilinear2d': lambda d: F.interpolate(t(1,3,5,5).to(d).requires_grad_(), scale_factor=2, mode='bilinear', align_corners=False),
 'interp_bicubic2d': lambda d: F.interpolate(t(1,3,5,5).to(d).requires_grad_(), scale_factor=2, mode='bicubic', align_corners=False),
 'interp_trilinear3d': lambda d: F.interpolate(t(1,3,4,4,4).to(d).requires_grad_(), scale_factor=2, mode='trilinear', align_corners=False),
 'interp_area2d': lambda d: F.interpolate(t(1,3,6,6).to(d).requires_grad_(), size=(3,3), mode='area'),
 'pad_constant': lambda d: F.pad(t(1,3,5,5).to(d).requires_grad_(), (1,1,1,1)),
 'pad_reflect': lambda d: F.pad(t(1,3,5,5).to(d).requires_grad_(), (1,1,1,1), mode='reflect'),
 'pad_replicate': lambda d: F.pad(t(1,3,5,5).to(d).requires_grad_(), (1,1,1,1), mode='replicate'),
 'pad_circular': lambda d: F.pad(t(1,3,5,5).to(d).requires_grad_(), (1,1,1,1), mode='circular'),
 'batch_norm': lambda d: F.batch_norm(t(2,3,5,5).to(d).requires_grad_(), None, None, t(3).to(d).requires_grad_(), t(3).to(d).requires_grad_(), training=True),
 'batch_norm_f32params': lambda d: F.batch_norm(t(2,3,5,5).to(d).requires_grad_(), None, None, t(3).requires_grad_(), t(3).requires_grad_(), training=True),
 'group_norm': lambda d: F.group_norm(t(2,4,5,5).to(d).requires_grad_(), 2, t(4).to(d).requires_grad_(), t(4).to(d).requires_grad_()),
 'layer_norm': lambda d: F.layer_norm(t(2,4,5,5).to(d).requires_grad_(), (5,5), t(5,5).to(d).requires_grad_(), t(5,5).to(d).requires_grad_()),
 'instance_norm': lambda d: F.instance_norm(t(2,4,5,5).to(d).requires_grad_(), weight=t(4).to(d).requires_grad_(), bias=t(4).to(d).requires_grad_()),
 'softmax': lambda d: F.softmax(t(2,4,5).to(d).requires_grad_(), -1),
 'log_softmax': lambda d: F.log_softmax(t(2,4,5).to(d).requires_grad_(), -1),
 'sum': lambda d: t(2,4,5).to(d).requires_grad_().sum(-1),
 'mean': lambda d: t(2,4,5).to(d).requires_grad_().mean(-1),
 'var': lambda d: t(2,4,5).to(d).requires_grad_().var(-1),
 'std': lambda d: t(2,4,5).to(d).requires_grad_().std(-1),
 'var_mean': lambda d: torch.var_mean(t(2,4,5).to(d).requires_grad_(), -1)[0],
 'amax': lambda d: t(2,4,5).to(d).requires_grad_().amax(-1),
 'amin': lambda d: t(2,4,5).to(d).requires_grad_().amin(-1),
 'max_dim': lambda d: t(2,4,5).to(d).requires_grad_().max(-1)[0],
 'prod': lambda d: t(2,4,5).to(d).requires_grad_().prod(-1),
 'norm': lambda d: t(2,4,5).to(d).requires_grad_().norm(dim=-1),
 'logsumexp': lambda d: t(2,4,5).to(d).requires_grad_().logsumexp(-1),
 'cumsum': lambda d: t(2,4,5).to(d).requires_grad_().cumsum(-1),
 'matmul': lambda d: t(2,4,5).to(d).requires_grad_() @ t(5,3).to(d).requires_grad_(),
 'bmm': lambda d: torch.bmm(t(2,4,5).to(d).requires_grad_(), t(2,5,3).to(d).requires_grad_()),
 'linear': lambda d: F.linear(t(2,4,5).to(d).requires_grad_(), t(3,5).to(d).requires_grad_(), t(3).to(d).requires_grad_()),
 'attention(matmul+softmax)': lambda d: (lambda q,k,v: torch.softmax(q@k.transpose(-1,-2)/2,-1)@v)(t(1,2,6,4).to(d).requires_grad_(),t(1,2,6,4).to(d).requires_grad_(),t(1,2,6,4).to(d).requires_grad_()),
 'scaled_dot_product_attention': lambda d: F.scaled_dot_product_attention(t(1,2,6,4).to(d).requires_grad_(),t(1,2,6,4).to(d).requires_grad_(),t(1,2,6,4).to(d).requires_grad_()),
 'mse_loss': lambda d: F.mse_loss(t(2,4,5).to(d).requires_grad_(), t(2,4,5).to(d)),
 'l1_loss': lambda d: F.l1_loss(t(2,4,5).to(d).requires_grad_(), t(2,4,5).to(d)),
 'smooth_l1_loss': lambda d: F.smooth_l1_loss(t(2,4,5).to(d).requires_grad_(), t(2,4,5).to(d)),
 'huber_loss': lambda d: F.huber_loss(t(2,4,5).to(d).requires_grad_(), t(2,4,5).to(d)),
 'cross_entropy': lambda d: F.cross_entropy(t(6,5).to(d).requires_grad_(), torch.randint(0,5,(6,))),
 'cross_entropy_spatial': lambda d: F.cross_entropy(t(2,5,4,4).to(d).requires_grad_(), torch.randint(0,5,(2,4,4))),
 'nll_loss': lambda d: F.nll_loss(t(6,5).to(d).requires_grad_(), torch.randint(0,5,(6,))),
 'nll_loss2d': lambda d: F.nll_loss(t(2,5,4,4).to(d).requires_grad_(), torch.randint(0,5,(2,4,4))),
 'bce': lambda d: F.binary_cross_entropy(torch.rand(6,5).to(d).requires_grad_(), torch.rand(6,5).to(d)),
 'bce_with_logits': lambda d: F.binary_cross_entropy_with_logits(t(6,5).to(d).requires_grad_(), torch.rand(6,5).to(d)),
 'relu': lambda d: F.relu(t(2,4,5).to(d).requires_grad_()),
 'gelu': lambda d: F.gelu(t(2,4,5).to(d).requires_grad_()),
 'silu': lambda d: F.silu(t(2,4,5).to(d).requires_grad_()),
 'tanh': lambda d: torch.tanh(t(2,4,5).to(d).requires_grad_()),
 'sigmoid': lambda d: torch.sigmoid(t(2,4,5).to(d).requires_grad_()),
 'exp': lambda d: torch.exp(t(2,4,5).to(d).requires_grad_()),
 'add_mul': lambda d: (t(2,4,5).to(d).requires_grad_()*2+1),
 'leaky_relu': lambda d: F.leaky_relu(t(2,4,5).to(d).requires_grad_()),
 'dropout': lambda d: F.dropout(t(2,4,5).to(d).requires_grad_(), 0.5),
}


def run(fn, d):
    torch.manual_seed(0)
    try:
        y = fn(d)
    except Exception as e:  # noqa: BLE001 (libtorch raises RuntimeError / NotImplementedError)
        return "no (" + str(e).split("\n")[0][:60] + ")"
    torch.manual_seed(0)
    try:
        r = fn(torch.float64)
        if y.shape != r.shape or (y.double() - r).abs().max() > 0.1 * r.abs().max() + 1e-3:
            return "wrong"
    except Exception:  # noqa: BLE001
        pass
    try:
        y.float().sum().backward()
    except Exception as e:  # noqa: BLE001
        return "forward only (" + str(e).split("\n")[0][:50] + ")"
    return "yes"


print("| op | float16 | bfloat16 |")
print("|---|---|---|")
for name, fn in cases.items():
    print(f"| {name} | {run(fn, torch.float16)} | {run(fn, torch.bfloat16)} |")
