"""The Mamba2 hybrids (Nemotron-H, Granite 4.0-H): their Mamba2 layers (``core/model/hybrid/mamba2.py``)
keep a state in the state pool beside the attention layers' paged K/V."""
