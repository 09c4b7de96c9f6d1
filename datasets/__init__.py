"""The paper's data: the synthetic bitstream task (``bitstream``), IRMAS MFCC features with their
cache and CLI (``irmas``), and the file and integer helpers the whole suite shares (``common``)."""
