"""Building blocks of the DPA4 model; each module is one kind of layer."""
