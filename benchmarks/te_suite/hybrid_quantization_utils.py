"""Names Transformer Engine's offloading test imports; their recipes need MXFP8 (Blackwell)."""


def hybrid_fp8_mxfp8_qfactory(*args, **kwargs):
    raise NotImplementedError("needs MXFP8")


def hybrid_mxfp8_nvfp4_qfactory(*args, **kwargs):
    raise NotImplementedError("needs MXFP8 and NVFP4")
