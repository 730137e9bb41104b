"""Every notebook in notebooks/ runs top to bottom."""

import glob
import os

import nbformat
import pytest
from conftest import ROOT
from nbclient import NotebookClient

NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path):
    notebook = nbformat.read(path, as_version=4)
    resources = {"metadata": {"path": os.path.dirname(path)}}
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources=resources).execute()
