"""ERNIE-5.5-Flash ECHO speculative draft for SGLang (`Ernie5_5MoeMTPModel`)."""

from torch import nn


class Ernie5_5MoeMTPModel(nn.Module):
    """Placeholder until the ECHO draft lands: registration is real, construction is not yet."""

    def __init__(self, config, quant_config=None, prefix: str = "") -> None:
        super().__init__()
        raise NotImplementedError(
            "sglang-ernie55: the ECHO draft class Ernie5_5MoeMTPModel is not implemented in this version yet"
        )


EntryClass = [Ernie5_5MoeMTPModel]
