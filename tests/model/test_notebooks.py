"""Every notebook in notebooks/ runs top to bottom. They run two at a time (each in a kernel process
of its own; most of their time is single-threaded compilation), started once for the session."""

import concurrent.futures
import glob
import os

import nbformat
import pytest
from conftest import ROOT
from nbclient import NotebookClient

NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))
# Run with -m slow only (the default run's time is bounded; their outputs are saved in the notebooks):
# dsa_selection's figures, and fine_tune, whose code the default run covers otherwise (`fine_tune`
# through `glm5next-jax train` in test_train_cli.py, overfitting a batch in test_train_step.py) and
# which took 250 s of a CI run's 2352 with the other notebooks beside it.
SLOW = {"dsa_selection.ipynb", "fine_tune.ipynb"}


def execute(path):
    notebook = nbformat.read(path, as_version=4)
    resources = {"metadata": {"path": os.path.dirname(path)}}
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources=resources).execute()


@pytest.fixture(scope="module")
def runs(request):
    """The selected notebooks' runs, all started at once, two at a time."""
    chosen = [item.callspec.params["path"] for item in request.session.items
              if getattr(item, "originalname", None) == "test_notebook_runs"]
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        yield {path: pool.submit(execute, path) for path in chosen}


@pytest.mark.parametrize(
    "path", [pytest.param(p, marks=pytest.mark.slow) if os.path.basename(p) in SLOW else p for p in NOTEBOOKS],
    ids=os.path.basename,
)
def test_notebook_runs(runs, path):
    runs[path].result()
