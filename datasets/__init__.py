"""The paper's data: the synthetic bitstream task (``bitstream``), IRMAS MFCC features with their
cache and CLI (``irmas``), a stand-in folder of synthetic clips in IRMAS's layout
(``synthetic_irmas``), and the file, integer and argument helpers the whole suite shares
(``common``)."""
