"""Framework integrations: verl's engine worker, the Hugging Face Trainer and Lightning.

Each lives in its own module and imports its framework only when that module is imported, so
``import rankmem`` never pulls in transformers or lightning. A missing framework raises
:class:`rankmem.MissingExtraError` naming the extra to install.
"""

from __future__ import annotations
