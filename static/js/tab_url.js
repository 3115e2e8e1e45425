// The chosen tab into the URL (?tab=), and into the page: the shared Run acts on it (run_open_tab.js) and page.css hides the shared prompt where the tab has its own; app/server/page.py tab_url_js.
() => { const q = new URLSearchParams(location.search); q.set('tab', '__TAB__');
        window.lmscopeTab = '__TAB__'; document.body.dataset.lmscopeTab = '__TAB__';
        history.replaceState(null, '', '?' + q.toString()); return []; }
