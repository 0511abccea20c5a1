"""The package `pip install --no-build-isolation ./python` installed (setup.sh runs it) imports
from anywhere, without PYTHONPATH or LVX_OPS_LIBRARY, loads its own _lvx_ops.so, and computes
single-process attention equal to SDPA (fp64, ≤ 1e-12)."""
import os
import sys

for var in ("PYTHONPATH", "LVX_OPS_LIBRARY"):
    if os.environ.get(var):
        sys.exit(f"run without {var} (it would hide the installed package)")
import torch  # noqa: E402
import lvx  # noqa: E402

here = os.path.dirname(os.path.abspath(lvx.__file__))
assert os.path.isfile(os.path.join(here, "_lvx_ops.so")), f"no _lvx_ops.so in {here}"
assert "site-packages" in here, f"lvx imported from {here}, not the installed package"
q, k, v = (torch.randn(2, 9, 4, 16, dtype=torch.float64) for _ in range(3))
o = lvx.attention(q, k, v, mask="causal")
ref = torch.nn.functional.scaled_dot_product_attention(
    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)
err = (o - ref).abs().max().item()
assert err <= 1e-12, f"installed lvx differs from SDPA by {err}"
print(f"installed lvx at {here}: ok (|err| {err:.1e})")
