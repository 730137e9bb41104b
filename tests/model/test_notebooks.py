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


def execute(path):
    notebook = nbformat.read(path, as_version=4)
    resources = {"metadata": {"path": os.path.dirname(path)}}
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources=resources).execute()


@pytest.fixture(scope="module")
def runs():
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        yield {path: pool.submit(execute, path) for path in NOTEBOOKS}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(runs, path):
    runs[path].result()
