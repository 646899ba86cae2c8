"""The package version (its own module so that submodules can read it without importing the
package root, which loads the compiled operators)."""
__version__ = "0.1.0"
