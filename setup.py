"""Everything is in pyproject.toml; this file only ships ``dcr-refit-skyrl.pth`` at the top of
site-packages (setuptools has no declarative way to place a file there). The .pth arms DCR's
SkyRL integration in interpreters where ``SKYRL_DCR_CONFIG`` is set and does nothing elsewhere
(vllm_dcr_plugin/frameworks/skyrl.py, docs/skyrl.md). Editable installs do not carry it:
``make setup`` copies it into the development environment."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = Path("vllm_dcr_plugin/frameworks/dcr-refit-skyrl.pth")


class BuildPy(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(str(PTH), str(Path(self.build_lib) / PTH.name), preserve_mode=False)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH.name)]


setup(cmdclass={"build_py": BuildPy})
