"""ERNIE-5.5-Flash main model for SGLang (`Ernie5_5_MoeForCausalLM`)."""

from torch import nn


class Ernie5_5_MoeForCausalLM(nn.Module):
    """Placeholder until the serving model lands: registration is real, construction is not yet."""

    def __init__(self, config, quant_config=None, prefix: str = "") -> None:
        super().__init__()
        raise NotImplementedError(
            "sglang-ernie55: the SGLang model class Ernie5_5_MoeForCausalLM is not implemented in this "
            "version yet (config, reference model and tooling are); see the project's issue on serving"
        )


EntryClass = [Ernie5_5_MoeForCausalLM]
