#!/usr/bin/env bash
# stamp.sh: run here, before a GPU call, from the repository root. Writes .gpu-stamp (git-ignored;
# name it in the call's carry) with the commit of the tree that travels, `+dirty` with changes to
# tracked files. The GPU machine receives the files but an older copy of .git, so the scripts there
# export FUSEDHEAD_GIT_COMMIT from this file and `fusedhead bench` records it as git_commit.
set -euo pipefail
commit=$(git rev-parse --short HEAD)
[[ -n $(git status --porcelain --untracked-files=no) ]] && commit="$commit+dirty"
echo "$commit" >.gpu-stamp
echo "stamped $commit"
