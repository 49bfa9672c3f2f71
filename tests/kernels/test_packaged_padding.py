"""A package of several batch sizes pads a call's batch up only where the model's rows are independent
(`opfuse.runtime.packaged`, `opfuse.ir.rows`), through Triton's interpreter on tiny models saved at batches 2 and 4.

A model whose rows interact (a softmax over the batch, `x - x.mean(0)`) padded from 3 to 4 is off by tenths, so its
package runs only 2 and 4 and refuses 3 naming the node; a model with independent rows runs 3 padded, as eager does.
"""

import pytest
import torch

import opfuse
from opfuse.ir.graph import GraphError
from opfuse.runtime.dynamic import padding_problem

BATCHES = (2, 4)


class RowWise(torch.nn.Module):
    """Every row alone: linear, layer norm over the features, a softmax over the features."""

    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.fc2 = torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3)

    def forward(self, x):
        return torch.softmax(self.fc2(torch.relu(self.norm(self.fc1(x)))), dim=-1)


class BatchSoftmax(torch.nn.Module):
    def forward(self, x):
        return torch.softmax(x, dim=0) * 2.0


class Centred(torch.nn.Module):
    def forward(self, x):
        return x - x.mean(0)


def rows(batch, seed=0):
    return torch.randn(batch, 4, generator=torch.Generator().manual_seed(seed))


def eager(model, x):
    with torch.no_grad():
        return model(x)


def packaged(model, tmp_path_factory):
    """(compiled models by batch, the package saved from them loaded back)."""
    compiled = {b: opfuse.compile(model, (rows(b),), opfuse.FusionConfig(dtype="float32")) for b in BATCHES}
    path = opfuse.save(list(compiled.values()), tmp_path_factory.mktemp("padding") / "model.opfuse")
    return compiled, opfuse.load(path, "cpu")


@pytest.fixture(scope="module")
def row_wise(tmp_path_factory):
    torch.manual_seed(0)
    model = RowWise().eval()
    return (model, *packaged(model, tmp_path_factory))


@pytest.fixture(scope="module", params=[BatchSoftmax, Centred], ids=["softmax_dim0", "minus_mean0"])
def mixing(request, tmp_path_factory):
    model = request.param().eval()
    return (model, *packaged(model, tmp_path_factory))


def test_a_model_with_independent_rows_pads_a_batch_between_its_sizes(row_wise):
    model, _, loaded = row_wise
    assert loaded.batch_sizes == [2, 4] and loaded.padding_refused_because is None
    assert "padding=rows independent" in repr(loaded)
    for batch in (1, 2, 3, 4):
        x = rows(batch, seed=batch)
        torch.testing.assert_close(loaded(x), eager(model, x), rtol=1e-4, atol=1e-5)
    assert loaded.compiled_for(3) is loaded.compiled_for(4)


def test_a_model_whose_rows_interact_runs_only_its_batch_sizes(mixing):
    model, _, loaded = mixing
    op = "softmax" if isinstance(model, BatchSoftmax) else "mean"
    assert f"[{op}]" in loaded.padding_refused_because and "reduces over the batch" in loaded.padding_refused_because
    assert f"padding=refused ({loaded.padding_refused_because})" in repr(loaded)
    for batch in BATCHES:
        x = rows(batch, seed=batch)
        torch.testing.assert_close(loaded(x), eager(model, x), rtol=1e-4, atol=1e-5)
    for batch in (1, 3):
        with pytest.raises(GraphError, match=rf"batch {batch}: .* runs only its batch sizes 2, 4, .*\[{op}\] "
                                             "reduces over the batch"):
            loaded(rows(batch))
    with pytest.raises(GraphError, match="runs only its batch sizes 2, 4"):
        loaded.compiled_for(3)


def test_padding_such_a_model_would_have_been_wrong(mixing):
    """What the package did before it checked: the batch-4 model on 3 rows and a copy of the last, cut back."""
    model, compiled, _ = mixing
    x = rows(3, seed=3)
    padded = compiled[4](torch.cat([x, x[-1:]]))[:3]
    assert (padded - eager(model, x)).abs().max() > 0.05


def test_save_warns_in_one_line_naming_the_node(row_wise, mixing, tmp_path):
    _, compiled, _ = mixing
    with pytest.warns(UserWarning, match=r"model\.opfuse runs only its batch sizes 2, 4, .*reduces over") as caught:
        opfuse.save([compiled[b] for b in BATCHES], tmp_path / "model.opfuse")
    (warning,) = [w for w in caught if "runs only" in str(w.message)]
    assert "\n" not in str(warning.message)
    loaded = opfuse.load(tmp_path / "model.opfuse", "cpu")
    assert loaded.padding_refused_because in str(warning.message)
    _, independent, _ = row_wise
    dim = loaded.dims[0]
    assert padding_problem(independent[4].compiled.plan.graph, dim)[1] is None
    assert padding_problem(compiled[4].compiled.plan.graph, dim)[1] == loaded.padding_refused_because
