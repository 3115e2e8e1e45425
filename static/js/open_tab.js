// On load: opens the tab the link named (?tab=); app/server/page.py OPEN_TAB_JS.
() => { const t = window.lmscopeOpenTab;
  // in a narrow window the tabs that do not fit are plain buttons of an overflow menu: any button will do
  if (t && t !== 'explore') { const m = [...document.querySelectorAll('#tabs button')].filter(
      x => x.textContent.trim().toLowerCase().replace(/ /g, '-') === t);
    const b = m.find(x => x.getAttribute('role') === 'tab') || m[m.length - 1]; if (b) b.click(); }
  return []; }
