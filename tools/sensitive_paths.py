"""Files no tool may read or write, whatever the mode, rules or workspace: data, kept apart from the
code that uses it (tools/policy.py's deny list), so that it can grow without touching logic.

They live under $HOME, so they matter when the workspace is $HOME or contains it (flashmoe refuses
such a workspace unless told otherwise; the list is the second line). Patterns are globs
(tools/globmatch.py); `~` is the user's home, `**` any depth.

Sources: each tool's documentation of where it keeps credentials or reads start-up code (bash(1)
INVOCATION, zsh(1) STARTUP/SHUTDOWN FILES, fish, git-config(1) FILES, systemd.unit(5) user unit
paths, XDG autostart, site(7) user site-packages, pip, npm, cargo, Hugging Face hub, psql PGPASSFILE,
Vault, Codex and Claude Code, rclone, Terraform, Kaggle, MySQL option files).
"""
from __future__ import annotations

# Code that runs later, outside the sandbox: shell and tool start-up files, programs found on the
# user's PATH, per-user services and autostart entries, Python's per-user start-up hooks.
START_UP_FILES: tuple[str, ...] = (
    "~/.bashrc", "~/.bash_profile", "~/.bash_login", "~/.bash_logout", "~/.profile", "~/.bash_aliases",
    "~/.zshrc", "~/.zshenv", "~/.zprofile", "~/.zlogin", "~/.zlogout", "~/.config/zsh/**", "~/.oh-my-zsh/**",
    "~/.kshrc", "~/.mkshrc", "~/.cshrc", "~/.tcshrc", "~/.login", "~/.logout", "~/.config/fish/**",
    "~/.inputrc", "~/.pam_environment", "~/.config/environment.d/**", "~/.xinitrc", "~/.xprofile",
    "~/.xsession*", "~/.xsessionrc", "~/.config/autostart/**", "~/.config/systemd/**", "~/.local/share/systemd/**",
    "~/.config/user-dirs.dirs", "~/.local/share/applications/**", "~/.local/bin/**", "~/bin/**",
    "~/.gitconfig", "~/.config/git/**", "~/.gitattributes", "~/.hgrc", "~/.vimrc", "~/.vim/**", "~/.exrc",
    "~/.config/nvim/**", "~/.emacs", "~/.emacs.d/**", "~/.config/emacs/**", "~/.tmux.conf", "~/.config/tmux/**",
    "~/.screenrc", "~/.wgetrc", "~/.curlrc", "~/.config/pip/**", "~/.pip/**", "~/.pydistutils.cfg", "~/.condarc",
    "~/.local/lib/python*/site-packages/**", "~/.pythonrc*", "~/.ipython/**", "~/.config/ipython/**",
    "~/.npmrc", "~/.yarnrc*", "~/.config/yarn/**", "~/.cargo/config*", "~/.cargo/bin/**", "~/.gemrc",
    "~/.m2/settings.xml", "~/.gradle/gradle.properties", "~/.gradle/init.d/**", "~/.config/direnv/**",
    "~/.direnvrc", "~/.ssh/**", "~/.config/Code/User/**", "~/.vscode/**", "~/.config/containers/**",
    "~/.docker/**",
)

# Secrets: credentials, tokens and keys, and histories that hold them (a password typed on a
# command line, a token in a psql session).
CREDENTIAL_STORES: tuple[str, ...] = (
    "~/.aws/**", "~/.azure/**", "~/.config/gcloud/**", "~/.oci/**", "~/.ibmcloud/**", "~/.config/doctl/**",
    "~/.netrc", "~/.authinfo*", "~/.git-credentials", "~/.config/git/credentials", "~/.config/gh/**",
    "~/.config/hub", "~/.config/glab-cli/**", "~/.kube/**", "~/.minikube/**", "~/.gnupg/**",
    "~/.password-store/**", "~/.local/share/keyrings/**", "~/.pki/**", "~/.config/sops/**", "~/.config/age/**",
    "~/.pypirc", "~/.cache/huggingface/token", "~/.cache/huggingface/stored_tokens", "~/.huggingface/token",
    "~/.pgpass", "~/.vault-token", "~/.codex/**", "~/.claude/**", "~/.claude.json", "~/.config/anthropic/**",
    "~/.config/openai/**", "~/.config/github-copilot/**", "~/.my.cnf", "~/.mylogin.cnf", "~/.s3cfg", "~/.boto",
    "~/.config/rclone/**", "~/.terraform.d/**", "~/.terraformrc", "~/.config/op/**", "~/.cargo/credentials*",
    "~/.gem/credentials", "~/.composer/auth.json", "~/.config/composer/auth.json", "~/.kaggle/**",
    "~/.config/kaggle/**", "~/.mozilla/**", "~/.config/google-chrome/**", "~/.config/chromium/**",
    "~/.thunderbird/**", "~/.bash_history", "~/.zsh_history", "~/.zhistory", "~/.histfile", "~/.history",
    "~/.sh_history", "~/.local/share/fish/**", "~/.python_history", "~/.node_repl_history", "~/.psql_history",
    "~/.mysql_history", "~/.sqlite_history", "~/.rediscli_history", "~/.lesshst", "~/.viminfo",
    "~/.local/share/recently-used.xbel", "~/.dbshell",
)
