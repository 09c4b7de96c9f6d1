"""The paper's data: the synthetic bitstream task (``bitstream``), IRMAS MFCC features with their
cache and CLI (``irmas``), a stand-in folder of synthetic clips in IRMAS's layout
(``synthetic_irmas``). The helpers the whole suite shares are in ``toolbox``."""
