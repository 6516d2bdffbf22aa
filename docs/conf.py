"""Sphinx configuration of mpicoll's documentation.

Build (the ``docs`` extra installs what it needs)::

    pip install -e '.[docs]'
    python -m sphinx -W -b html docs docs/_build/html

The pages are Markdown (MyST).  The reference pages are generated: the API
from the docstrings (autodoc), the options, algorithm and "auto" tables from
the package's own tables (``docs/_ext/mpicoll_docs.py``).
"""

import configparser
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "docs", "_ext"))

_setup = configparser.ConfigParser()
_setup.read(os.path.join(ROOT, "setup.cfg"))

project = "mpicoll"
author = "the mpicoll developers"
copyright = "the mpicoll developers, MIT license"
release = version = _setup["metadata"]["version"]

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "mpicoll_docs",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_ext"]

# Headings get anchors down to level 3, so that pages can link to sections
# ("tuning.md#the-tuning-file").
myst_heading_anchors = 3
myst_enable_extensions = ["deflist"]  # the glossary (design.md)

# mpicoll imports mpi4py at import time, and mpi4py loads an MPI library then,
# which the documentation build neither needs nor has (the docs extra installs
# none: an MPI wheel beside a site's MPI would change which library mpi4py
# loads).  autodoc reads only names, signatures and docstrings, none of which
# depends on the MPI library, so mpi4py is mocked: a default such as
# ``op=MPI.SUM`` reads ``mpi4py.MPI.SUM``.  mpicoll.torch is not imported at
# all: importing it registers the backend with torch (docs/api.md says where
# its reference is).
autodoc_mock_imports = ["mpi4py"]
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False  # "Returns:" reads as one description, not a type

# furo: a fluid layout, so result comments in code and wide tables get the window's
# width instead of a fixed column (docs/check_layout.py checks every page in a browser)
html_theme = "furo"
html_title = f"mpicoll {release}"
html_static_path = ["_static"]
html_css_files = ["mpicoll.css"]  # program output wraps; long code spans in tables break
