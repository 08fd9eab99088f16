"""Pure-PyTorch reference of ERNIE-5.5-Flash: the oracle all kernels, the SGLang model and ECHO are tested against."""

from .model import Ernie55Cache, Ernie55ReferenceModel, RefOutput, build_reference

__all__ = ["Ernie55ReferenceModel", "Ernie55Cache", "RefOutput", "build_reference"]
