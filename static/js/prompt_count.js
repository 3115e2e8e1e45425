// On load: the prompt's length under it as the user types or pastes (characters; its tokens are counted when it runs); app/server/page.py.
() => {
  const fmt = (n) => n.toLocaleString('en-US');
  document.addEventListener('input', (e) => {
    if (!e.target.closest || !e.target.closest('#prompt')) return;
    const n = [...(e.target.value || '')].length;
    const chars = document.querySelector('#prompt-chars');
    const tokens = document.querySelector('#prompt-tokens');
    if (chars) {
      const cap = Number(chars.dataset.cap);  // the server's cap in characters, written by page.py
      chars.textContent = fmt(n) + ' characters' + (n > cap
        ? ", over this server's " + fmt(cap) + ': shorten it, or tick Truncate to keep its end'
        : ' (at most ' + fmt(cap) + ')');
      chars.className = n > cap ? 'over' : '';
    }
    if (tokens) tokens.textContent = ' · tokens counted when it runs';
  });
  return [];
}
